"""`make demo` end to end on a tiny model: server up, one chat answer with RL fields, clean exit."""

from asyncgrpo import demo


def test_demo_prints_tokens_logprobs_and_versions(tiny_model_dir, capsys):
    assert (
        demo.main(
            ["--serve", "--model", str(tiny_model_dir), "--dtype", "float32", "--max-tokens", "5"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "assistant:" in out and "finish_reason: length" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("  ") and "." in line]
    assert len(rows) == 5
    for token_id, logprob, version, *_ in rows:
        assert int(token_id) >= 0 and float(logprob) <= 0 and int(version) == 0
