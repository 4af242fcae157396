"""A throwaway PostgreSQL server for the tests of shared Optuna studies: its own
cluster in a temporary folder, on a free port of 127.0.0.1, trusting local users,
stopped and deleted afterwards. It needs the server's programs (``initdb``,
``pg_ctl``: Debian's ``postgresql`` package); without them the tests are skipped,
unless OVERLAPKIT_REQUIRE_POSTGRES=1 (CI) makes that an error."""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

REQUIRED = os.environ.get("OVERLAPKIT_REQUIRE_POSTGRES") == "1"


def _program(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return candidates[-1] if candidates else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _unavailable(reason: str) -> None:
    if REQUIRED:
        pytest.fail(f"PostgreSQL is required here (OVERLAPKIT_REQUIRE_POSTGRES=1): {reason}")
    pytest.skip(reason)


@contextlib.contextmanager
def throwaway_postgres() -> Iterator[str]:
    """Start a server; yield its SQLAlchemy URL (database ``postgres``)."""
    initdb, pg_ctl = _program("initdb"), _program("pg_ctl")
    if not initdb or not pg_ctl:
        _unavailable("no PostgreSQL server programs (apt-get install postgresql)")
    try:
        import psycopg2  # noqa: F401
    except ImportError:
        _unavailable("psycopg2 is not installed (pip install 'overlapkit[postgres]')")
    # The server refuses to run as root: then it runs as the postgres user.
    user = None
    if os.geteuid() == 0:
        try:
            user = pwd.getpwnam("postgres")
        except KeyError:
            _unavailable("running as root and there is no postgres user to run the server")
    folder = Path(tempfile.mkdtemp(prefix="overlapkit-pg-"))
    data, sockets = folder / "data", folder / "sockets"
    sockets.mkdir()
    if user is not None:
        for path in (folder, sockets):
            os.chown(path, user.pw_uid, user.pw_gid)
    port = _free_port()

    def as_server(*command: str) -> None:
        prefix = ["runuser", "-u", "postgres", "--"] if user is not None else []
        subprocess.run([*prefix, *command], check=True, capture_output=True, timeout=120)

    options = f"-c listen_addresses=127.0.0.1 -p {port} -k {sockets} -c fsync=off"
    try:
        as_server(initdb, "-D", str(data), "--auth=trust", "-U", "postgres", "--no-sync")
        as_server(pg_ctl, "-D", str(data), "-o", options, "-w", "-l", str(folder / "log"), "start")
        try:
            yield f"postgresql+psycopg2://postgres@127.0.0.1:{port}/postgres"
        finally:
            as_server(pg_ctl, "-D", str(data), "-m", "fast", "-w", "stop")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
