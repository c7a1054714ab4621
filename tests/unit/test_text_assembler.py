"""Incremental detokenization: streamed pieces add up to the full text, stop strings are cut."""

import pytest

from asyncgrpo.inference.server.generation import TextAssembler
from asyncgrpo.testing import build_tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


TEXT = "Hé said: naïve café — 12 + 7 = 19 ✓ done"


def test_pieces_add_up_and_never_show_half_characters(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(ids) > len(TEXT) // 2  # byte-level pieces: multi-byte characters span tokens
    stream = TextAssembler(tokenizer, [])
    pieces = [stream.push([t]) for t in ids[:-1]]
    pieces.append(stream.finish(ids[-1:], None))
    assert "".join(pieces) == TEXT == stream.text
    assert not any("\ufffd" in p for p in pieces)
    assert TextAssembler(tokenizer, []).finish(ids, None) == TEXT


@pytest.mark.parametrize("stop", ["café", "é", "naïve café —"])
def test_stop_string_is_held_back_then_cut(tokenizer, stop):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    stream = TextAssembler(tokenizer, [stop])
    released = ""
    for i, t in enumerate(ids):
        if stop in tokenizer.decode(ids[: i + 1]):  # where the engine stops
            released += stream.finish([t], stop)
            break
        released += stream.push([t])
        assert stop not in released
    assert released == TEXT[: TEXT.index(stop)]
    kept = TextAssembler(tokenizer, [stop], include_stop=True)
    end = TEXT.index(stop) + len(stop)
    assert kept.finish(ids, stop) == TEXT[:end]
