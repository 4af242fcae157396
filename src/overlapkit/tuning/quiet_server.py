"""Imported first by the server a tune's trials are forked from (`trial_process`):
it imports torch and overlapkit for seconds, in the terminal's process group, and
Ctrl-C there printed its KeyboardInterrupt traceback (the tune itself stops on it).
The server ignores SIGINT from here on, as it does once its imports are done; each
trial forked from it takes Python's handler back (`command_main`)."""

import signal

signal.signal(signal.SIGINT, signal.SIG_IGN)
