"""A throwaway PostgreSQL server on loopback, for the tests marked `postgres`.

    python tests/postgres_server.py -- COMMAND...

initialises a cluster in a fresh temporary directory (Debian's `postgresql` package: the
binaries under /usr/lib/postgresql/<version>/bin), starts it on 127.0.0.1 at a free port
with durability off (a test database need not survive a power cut), runs COMMAND with
`ASYNCGRPO_TEST_POSTGRES_URL` naming it, then stops it and removes the directory; the exit
status is COMMAND's. PostgreSQL refuses to run as root, so as root the cluster is the
`postgres` user's (the package creates that user). `make test-postgres` installs the
package and runs the tests this way.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

URL_ENV = "ASYNCGRPO_TEST_POSTGRES_URL"


def postgres_bin() -> Path:
    """The newest installed PostgreSQL's binary directory."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"), key=lambda p: int(p.parts[-3]))
    if not found:
        raise FileNotFoundError(
            "no PostgreSQL server binaries under /usr/lib/postgresql: apt-get install -y postgresql"
        )
    return found[-1].parent


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def throwaway_postgres() -> Iterator[str]:
    """A running cluster's URL (superuser `postgres`, no password, loopback only)."""
    bindir = postgres_bin()
    root = Path(tempfile.mkdtemp(prefix="asyncgrpo-postgres-"))
    as_user: list[str] = []
    if os.geteuid() == 0:
        owner = pwd.getpwnam("postgres")
        os.chown(root, owner.pw_uid, owner.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    data, port = root / "data", _free_port()

    def run(*command: str) -> None:
        subprocess.run([*as_user, *command], check=True, capture_output=True, text=True)

    try:
        run(str(bindir / "initdb"), "-D", str(data), "-U", "postgres", "-A", "trust", "-N")
        options = f"-c listen_addresses=127.0.0.1 -p {port} -k {root} -c fsync=off"
        log = ["-l", str(root / "log")]
        run(str(bindir / "pg_ctl"), "-D", str(data), "-o", options, *log, "-w", "-t", "60", "start")
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    except subprocess.CalledProcessError as exc:
        log = root / "log"
        raise RuntimeError(
            f"{' '.join(exc.cmd)} failed: {exc.stderr.strip()}\n"
            + (log.read_text() if log.exists() else "")
        ) from None
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            run(str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str]) -> int:
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        print("usage: python tests/postgres_server.py -- COMMAND...", file=sys.stderr)
        return 2
    command = argv[argv.index("--") + 1 :]
    with throwaway_postgres() as url:
        print(f"PostgreSQL on loopback: {url}", flush=True)
        return subprocess.call(command, env=dict(os.environ, **{URL_ENV: url}))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
