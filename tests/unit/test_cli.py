"""`asyncgrpo` command line: clean one-line errors, and `train` handed to the run module."""

import subprocess
import sys

from asyncgrpo import cli


def test_missing_model_directory_is_one_clean_line(tmp_path, capsys):
    missing = tmp_path / "no-such-model"
    assert cli.main(["serve", "--model", str(missing)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and str(missing) in err and "\n" not in err


def test_directory_without_a_model_is_refused(tmp_path, capsys):
    assert cli.main(["serve", "--model", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("error:")


def test_the_real_command_prints_no_traceback(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "asyncgrpo.cli", "serve", "--model", str(tmp_path / "missing")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "Traceback" not in out.stderr and out.stderr.startswith("error:")


def test_train_is_handed_to_the_run_module(capsys):
    assert cli.main(["train", "--help-config"]) == 0
    assert capsys.readouterr().out.strip()
