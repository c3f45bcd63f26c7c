"""What every worker process does to live and die with the loader that owns
it, and to report to it: Ctrl-C left to the parent, an exit the moment the
owner is gone (however it died), and messages (exceptions included) that
always reach the parent in a form it can unpickle."""

from __future__ import annotations

import os
import pickle
import re
import signal
import sys
import threading
import traceback
from typing import Any

__all__ = ["RemoteTraceback", "guard", "report", "send", "starting_hint", "unguarded_main"]


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
    """Sends an exception of this worker to the parent, which raises it. One
    that would end the training process (``sys.exit()``, a KeyboardInterrupt
    raised by worker code) or that the parent could not rebuild (an exception
    whose constructor takes other arguments than its message) goes as a
    RuntimeError naming its type and message; the traceback goes as text."""
    text = traceback.format_exc()
    if isinstance(error, RuntimeError) and isinstance(error.__cause__, StopIteration):
        error = error.__cause__  # a cause does not pickle: the parent's Failure wraps it again
    elif not isinstance(error, Exception):
        error = RuntimeError(f"{type(error).__name__}({error}) raised in dataecho worker {worker} by the "
                             f"dataset, transform or augment; a worker cannot end the training process")
    elif not _rebuilds(error):
        error = RuntimeError(f"{type(error).__module__}.{type(error).__qualname__}: {error} (raised in dataecho "
                             f"worker {worker}; the exception itself cannot be rebuilt from a pickle)")
    send(conn, ("error", worker, error, text))


def _rebuilds(error: BaseException) -> bool:
    """The parent can unpickle ``error`` (its constructor takes its ``args``)."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:  # noqa: BLE001 - any failure to round-trip
        return False
    return True


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


def unguarded_main() -> str | None:
    """The path of the main script where it has no ``if __name__ == "__main__":``
    guard, else None. A worker process started by forkserver or spawn imports
    the main script again; without the guard it builds and iterates the loader
    there, and starting processes while the worker itself starts fails."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    if not path:
        return None  # an interactive session, or python -c: nothing is imported again
    try:
        with open(path, encoding="utf-8", errors="replace") as script:
            source = script.read()
    except OSError:
        return None
    return None if re.search(r"""__name__\s*==\s*['"]__main__['"]""", source) else path


def starting_hint(path: str) -> str:
    """What to do about a worker that exited as it started, in a script without the guard."""
    return (f". It exited as it started, and {path} has no `if __name__ == \"__main__\":` guard: worker "
            f"processes import the main script again, so the code that builds and iterates the loader must be "
            f"under that guard (as with DataLoader's worker processes), or use worker_type=\"thread\"")
