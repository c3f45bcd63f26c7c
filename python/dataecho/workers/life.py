"""What every worker process does to live and die with the loader that owns
it, and to report to it: Ctrl-C left to the parent, an exit the moment the
owner is gone (however it died), and messages (exceptions included) that
always reach the parent in a form it can unpickle."""

from __future__ import annotations

import os
import signal
import sys
import threading
import traceback
from typing import Any

__all__ = ["RemoteTraceback", "guard", "report", "send"]


def guard(lifeline: Any) -> int | None:
    """Arms this worker process against outliving its owner: SIGINT ignored
    (Ctrl-C reaches the whole process group; the parent decides, and stops us),
    an exit at the lifeline's EOF, SIGKILL when the parent dies. Returns the
    parent's pid, or None where the parent died before the signal was armed."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _watch_owner(lifeline)
    parent = os.getppid()  # the loader, or the forkserver
    _die_with_parent()
    return None if os.getppid() != parent else parent


def report(conn: Any, worker: int, error: BaseException) -> None:
    """Sends an exception of this worker to the parent, which raises it."""
    if isinstance(error, RuntimeError) and isinstance(error.__cause__, StopIteration):
        error = error.__cause__  # a cause does not pickle: the parent's Failure wraps it again
    send(conn, ("error", worker, error, traceback.format_exc()))


def send(conn: Any, message: tuple) -> None:
    try:
        conn.send(message)
    except Exception:
        # The exception itself may not pickle: send what can be shown.
        if message[0] == "error":
            _, worker, error, text = message
            conn.send(("error", worker, RuntimeError(f"{type(error).__name__}: {error}"), text))
        else:
            raise


def _watch_owner(lifeline: Any) -> None:
    """Ends this process as soon as the owner of the loader is gone, whatever this
    process is doing (waiting for a slot, or inside the user's code): nothing is
    ever written to the lifeline, so it becomes readable only at EOF, when its
    one writer, the owner, has exited."""

    def watch() -> None:
        try:
            lifeline.poll(None)
        except (OSError, EOFError):
            pass
        os._exit(0)  # nobody is left to report to

    threading.Thread(target=watch, name="dataecho-owner-watch", daemon=True).start()


def _die_with_parent() -> None:
    """Linux: get SIGKILL when the parent dies, so no worker outlives it."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker process, as text."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return f'\n"""\n{self.text}"""'
