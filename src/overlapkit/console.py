"""The ``overlapkit`` command: the CLI, and a quiet end to a Ctrl-C that comes while
it and torch are still being imported (a second or more)."""

from __future__ import annotations

import signal
import sys


def main() -> int:
    try:
        # numpy first: torch imports it from its C extension's start and drops any error
        # there, a Ctrl-C's KeyboardInterrupt too (the command went on, or failed later
        # on a half-imported numpy).
        import numpy  # noqa: F401

        from .cli import main as cli_main
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    code = cli_main()
    # Done: a Ctrl-C from here on ends the process at once, as interrupted (a
    # KeyboardInterrupt in an exit hook of torch's printed a traceback).
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    return code
