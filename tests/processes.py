"""The process table, for tests that check that no worker process is left."""

from __future__ import annotations

import os


def descendants() -> dict[int, str]:
    """Live descendants of this process (zombies excluded), without multiprocessing's
    forkserver and resource tracker, which live until the interpreter exits."""
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
    found, frontier = {}, [os.getpid()]
    while frontier:
        pid = frontier.pop()
        for child, ppid in parent.items():
            if ppid == pid and child not in found:
                found[child] = cmdline[child]
                frontier.append(child)
    helpers = {
        p for p, c in found.items() if parent[p] == os.getpid() and ("forkserver" in c or "resource_tracker" in c)
    }
    return {p: c for p, c in found.items() if p not in helpers}
