"""What a process has running, for tests that check that nothing is left behind:
child processes, threads (native ones too) and dataecho's /dev/shm segments."""

from __future__ import annotations

import multiprocessing
import os
import threading


def descendants() -> dict[int, str]:
    """Live descendants of this process (zombies excluded), without multiprocessing's
    forkserver and resource tracker, which live until the interpreter exits."""
    found, parent = _tree(os.getpid())
    helpers = {
        p for p, c in found.items() if parent[p] == os.getpid() and ("forkserver" in c or "resource_tracker" in c)
    }
    return {p: c for p, c in found.items() if p not in helpers}


def family(pid: int) -> dict[int, str]:
    """Every live descendant of process `pid` (pid -> command line), helpers included."""
    return _tree(pid)[0]


def _tree(root: int) -> tuple[dict[int, str], dict[int, int]]:
    """(live descendants of `root`: pid -> command line, every live pid -> its parent)."""
    parent, cmdline = {}, {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    command = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if fields[0] != "Z":
                parent[int(entry)] = int(fields[1])
                cmdline[int(entry)] = command
    found, frontier = {}, [root]
    while frontier:
        pid = frontier.pop()
        for child, ppid in parent.items():
            if ppid == pid and child not in found:
                found[child] = cmdline[child]
                frontier.append(child)
    return found, parent


def pid_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def native_threads() -> dict[int, str]:
    """This process's threads (tid -> name), Python's and native ones alike."""
    threads = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                threads[int(tid)] = f.read().strip()
        except OSError:
            pass  # it just ended
    return threads


def dataecho_threads() -> list[str]:
    """The names of this process's Python threads that dataecho started."""
    return [t.name for t in threading.enumerate() if t.name.startswith("dataecho-")]


def worker_processes() -> list[multiprocessing.Process]:
    """dataecho's worker processes started by this process and still running."""
    return [p for p in multiprocessing.active_children() if p.name.startswith("dataecho-worker")]


def shm_segments(pid: int | None = None) -> list[str]:
    """dataecho's /dev/shm segments (named dataecho-<pid>-...), sorted: those of
    process `pid`, or with None those of every process on the machine."""
    if not os.path.isdir("/dev/shm"):
        return []
    prefix = "dataecho-" if pid is None else f"dataecho-{pid}-"
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith(prefix))
