"""Ending a benchmark or test process once its result is written (each rank, each process)."""

from __future__ import annotations

import atexit
import os
import sys
import threading

__all__ = ["exit_without_teardown"]


def exit_without_teardown(code: int) -> None:
    """End this process as interpreter shutdown would, less its last step: wait for the threads that
    are not daemons (one that never ends still hangs the process) and run the atexit handlers, then
    leave without tearing down every module. That teardown only frees memory, and costs about a
    second of CPU per process once torch is imported (more than many tests' own work)."""
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
