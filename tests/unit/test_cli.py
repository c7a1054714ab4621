"""`asyncgrpo` command line: clean one-line errors, `train` handed to the run module, and the
open-file limit `serve` raises so that its connection cap, not the limit, bites."""

import resource
import subprocess
import sys

from asyncgrpo import cli
from asyncgrpo.inference.server.connections import FD_RESERVE, connection_cap


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


def test_serve_raises_the_open_file_limit_and_caps_connections_below_it():
    script = (
        "import resource\n"
        "from asyncgrpo.inference.server.connections import raise_fd_limit\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 300), hard))\n"
        "print(*raise_fd_limit(), resource.getrlimit(resource.RLIMIT_NOFILE)[0], hard)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    before, after, now, hard = (int(x) for x in out.stdout.split())
    assert before <= 300 and after == now
    if hard != resource.RLIM_INFINITY:
        assert now == hard
    # the cap leaves descriptors for the model files, logs and weight segments
    assert connection_cap(1024, 20000) == 1024
    assert connection_cap(1024, 1024) == 1024 - FD_RESERVE
    assert connection_cap(1024, resource.RLIM_INFINITY) == 1024
