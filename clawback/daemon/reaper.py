"""Ends the daemon's local Ray runtime with the daemon, however the daemon ends.

Ray ties its GCS and raylet to the process that starts them (they die with it, also on kill -9),
but not the agents the raylet starts (DashboardAgent, RuntimeEnvAgent): they outlive a daemon
that was stopped or killed, reparented to init. This small process, started with the runtime,
notes every descendant of the daemon once a second; when the daemon is gone (its end of a pipe
closes, which the kernel does on any exit) it ends those still running (SIGTERM, then SIGKILL
after GRACE_S) and deletes the runtime's private temp dir. It reads /proc, so it runs on Linux;
elsewhere nothing starts it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

GRACE_S = 5.0
POLL_S = 1.0


def start(temp_dir: str) -> subprocess.Popen | None:
    """Start the reaper for this process (None where there is no /proc). Keep the returned
    process referenced: its stdin is the pipe whose closing means this process is gone."""
    if not Path("/proc/self/stat").is_file():
        return None
    return subprocess.Popen([sys.executable, "-m", "clawback.daemon.reaper", str(os.getpid()), temp_dir],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True)


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, start time) of every process."""
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue  # gone meanwhile
            out[int(entry.name)] = (int(fields[1]), fields[19])
    return out


def descendants(root: int) -> dict[int, str]:
    """pid -> start time of every process below `root` (the start time tells a reused pid apart)."""
    procs = _processes()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    found, frontier = {}, [root]
    while frontier:
        pid = frontier.pop()
        for child in children.get(pid, []):
            if child not in found:
                found[child] = procs[child][1]
                frontier.append(child)
    return found


def _still_running(seen: dict[int, str]) -> list[int]:
    procs = _processes()
    return [pid for pid, started in seen.items() if procs.get(pid, (0, ""))[1] == started]


def end(seen: dict[int, str]) -> None:
    """SIGTERM the processes still running, SIGKILL those left after GRACE_S."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in _still_running(seen):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + GRACE_S
        while _still_running(seen) and time.monotonic() < deadline:
            time.sleep(0.1)


def main(daemon_pid: int, temp_dir: str) -> None:
    gone = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.buffer.read(), gone.set()), daemon=True).start()
    seen: dict[int, str] = {}
    while not gone.wait(POLL_S):
        seen.update(descendants(daemon_pid))
    seen.pop(os.getpid(), None)
    end(seen)
    shutil.rmtree(temp_dir, ignore_errors=True)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C to the daemon's terminal: the daemon's to handle
    main(int(sys.argv[1]), sys.argv[2])
