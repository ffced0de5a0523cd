"""Where the shell scenario runs the policy's commands: one task directory, nothing outside it.

Two backends, chosen once per process (`Sandbox.detect`):

- **bwrap** (bubblewrap, Debian's `bubblewrap`): the command runs in new user, mount, PID, network,
  IPC and UTS namespaces, as an unprivileged user, with `/usr` read-only, an empty `/tmp` of its
  own, and the task directory bound read-write at `/work`, the only path of the host it can see. No
  network (an empty network namespace). When the command's shell exits, everything it started
  dies with the namespace.
- **rlimits**, where bwrap cannot run: a subprocess in the task directory with a scrubbed
  environment, as an unprivileged user when started as root, in a network namespace of its own
  when the kernel allows one (`unshare(CLONE_NEWNET)`), and a command that names a path outside the
  directory (`..`, an absolute path other than the system's programs, `~`) is refused before it
  runs. It keeps an honest model in its directory; it is no boundary against a hostile one.

Both set the same limits (resource.setrlimit before the command starts): CPU seconds, the size of
any file written, address space, the number of processes of the sandbox's user (a fork bomb stops
there); a wall-clock limit kills the whole process group; output past `OUTPUT_KILL_BYTES` stops the
command, and only its last `RESULT_CHARS` characters come back.

The result text has the shape of OpenClaw's exec tool (dist/bash-tools.exec-runtime and
bash-tools.exec-output): stdout and stderr interleaved, "(no output)" for none, then
"(Command exited with code N)" for a non-zero exit; "Command not found" for 127, "Command timed
out after N seconds." for a timeout, "Command aborted by signal SIGKILL" for a kill, and
"[earlier output was discarded at the retention cap and cannot be recovered]" before a tail.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import resource
import shutil
import signal
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

WALL_S = 10.0  # one command's wall-clock limit
CPU_S = 5  # its CPU seconds (RLIMIT_CPU: SIGXCPU, then SIGKILL)
FILE_BYTES = 1 << 20  # the largest file it may write (RLIMIT_FSIZE)
MEMORY_BYTES = 1 << 30  # address space (RLIMIT_AS)
PROCESSES = 64  # processes of the sandbox's user (RLIMIT_NPROC)
OUTPUT_KILL_BYTES = 1 << 20  # output past this stops the command
RESULT_CHARS = 2000  # the tail of the output that comes back
RETENTION_NOTE = "[earlier output was discarded at the retention cap and cannot be recovered]\n\n"
SANDBOX_UID = 65534  # nobody: when started as root, commands run as this user
INSIDE = "/work"  # where the task directory appears inside bwrap
PATH = "/usr/local/bin:/usr/bin:/bin"
CLONE_NEWNET = 0x40000000


@dataclass(frozen=True)
class ExecResult:
    command: str
    exit_code: int | None  # None: killed (signal, timeout, output limit) or refused before it ran
    output: str  # stdout and stderr as they came, the tail of it when over RESULT_CHARS
    signal: str | None = None
    timed_out: bool = False
    output_capped: bool = False  # stopped for writing more than OUTPUT_KILL_BYTES
    truncated: bool = False  # only the output's tail is kept
    refused: str | None = None  # why the command did not run

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def text(self) -> str:
        """The tool result as OpenClaw's exec tool words it."""
        head = RETENTION_NOTE if self.truncated else ""
        if self.refused:
            return f"{self.refused}"
        if self.timed_out:
            return _join(self.output, f"Command timed out after {WALL_S:g} seconds.")
        if self.output_capped:
            return head + _join(self.output, f"Command aborted by signal SIGKILL (output over {OUTPUT_KILL_BYTES} bytes)")
        if self.signal:
            return head + _join(self.output, f"Command aborted by signal {self.signal}")
        if self.exit_code == 127:
            return head + _join(self.output, "Command not found")
        if self.exit_code == 126:
            return head + _join(self.output, "Command not executable (permission denied)")
        body = head + (self.output or "(no output)")
        return body if self.exit_code == 0 else f"{body}\n\n(Command exited with code {self.exit_code})"


def _join(output: str, reason: str) -> str:
    return f"{output}\n\n{reason}" if output else reason


def _limits(processes: int) -> None:
    for which, value in ((resource.RLIMIT_CPU, CPU_S), (resource.RLIMIT_FSIZE, FILE_BYTES),
                         (resource.RLIMIT_AS, MEMORY_BYTES), (resource.RLIMIT_NPROC, processes),
                         (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(which, (value, value))


def _drop_root() -> None:
    if os.geteuid() == 0:
        os.setgroups([])
        os.setgid(SANDBOX_UID)
        os.setuid(SANDBOX_UID)


def _own(workdir: Path) -> None:
    """The sandbox's user may write the task directory (and nothing the host owns)."""
    if os.geteuid() != 0:
        return
    for root, dirs, files in os.walk(workdir):
        for name in [Path(root), *(Path(root) / n for n in dirs + files)]:
            os.lchown(name, SANDBOX_UID, SANDBOX_UID)


# Absolute paths a command may name in the rlimits backend: the system's programs, a few devices.
_SYSTEM = re.compile(r"^/(?:usr/)?(?:local/)?s?bin/[\w.+-]+$|^/dev/(?:null|zero|u?random)$")
_TOKEN = re.compile(r"[^\s;&|<>]+")  # a shell word, quotes and all
_WORD = re.compile(r"[^\s;&|<>()'\"`=,]+")  # a path-like piece of one, also inside a quoted program


def escapes(command: str) -> str | None:
    """A path in the command that leaves its directory, if any: the root itself, one with a `..`
    component, one from `~`, or an absolute path under a directory the host has (an awk or sed
    `/regex/` names none) other than a system program or a device like /dev/null."""
    command = command.replace("\\", "")
    for token in _TOKEN.findall(command):
        bare = token.strip("'\"`")
        if "/" in bare and not bare.strip("/"):  # a lone quote (of a quoted space) names no path
            return token
    for word in (re.sub("/+", "/", w) for w in _WORD.findall(command)):
        if word.startswith("~") or ".." in word.split("/"):
            return word
        top = word.split("/")[1] if word.startswith("/") else ""
        if top and os.path.lexists(f"/{top}") and not _SYSTEM.match(word):
            return word
    return None


def _processes_of(uid: int) -> int:
    n = 0
    for p in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            n += p.name.isdigit() and p.stat().st_uid == uid
    return n


def task_directory() -> Path:
    """A fresh, empty task directory in the system's temp dir, whose parents the sandbox's user can
    search (a bind source it cannot reach fails); the caller removes it."""
    return Path(tempfile.mkdtemp(prefix="clawback-shell-task-"))


class Sandbox:
    def __init__(self, backend: str) -> None:
        if backend not in ("bwrap", "rlimits"):
            raise ValueError(f"unknown sandbox backend {backend!r}")
        self.backend = backend

    @classmethod
    def detect(cls) -> Sandbox:
        """bwrap when it is installed and can make its namespaces here, else rlimits."""
        if shutil.which("bwrap"):
            d = task_directory()
            try:
                probe = cls("bwrap").run("echo ok", d)
            finally:
                shutil.rmtree(d, ignore_errors=True)
            if probe.exit_code == 0 and probe.output.strip() == "ok":
                return cls("bwrap")
        return cls("rlimits")

    @property
    def workdir_name(self) -> str:
        """How the task directory is named to the policy."""
        return INSIDE if self.backend == "bwrap" else "the current directory"

    def _argv(self, command: str, workdir: Path) -> list[str]:
        if self.backend == "rlimits":
            return ["/bin/sh", "-c", command]
        system = []  # /bin, /lib, ... as the host has them: links into /usr (merged /usr) or directories
        for d in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
            if Path(d).is_symlink():
                system += ["--symlink", str(Path(d).readlink()), d]
            elif Path(d).is_dir():
                system += ["--ro-bind", d, d]
        if Path("/etc/alternatives").is_dir():  # Debian's awk, editor, ... are links through it
            system += ["--ro-bind", "/etc/alternatives", "/etc/alternatives"]
        return ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--ro-bind", "/usr", "/usr",
                *system, "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp",
                "--bind", str(workdir), INSIDE, "--chdir", INSIDE, "--clearenv",
                "--setenv", "PATH", PATH, "--setenv", "HOME", INSIDE, "--setenv", "LANG", "C.UTF-8",
                "/bin/sh", "-c", command]

    def _preexec(self, processes: int) -> None:
        _limits(processes)
        if self.backend == "rlimits" and os.geteuid() == 0:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.unshare(CLONE_NEWNET)  # no network where the kernel allows it; best effort
        _drop_root()

    def run(self, command: str, workdir: Path) -> ExecResult:
        if self.backend == "rlimits" and (word := escapes(command)):
            return ExecResult(command, None, "", refused=f"Command refused: {word!r} is outside the task directory")
        _own(workdir)
        # RLIMIT_NPROC counts every process of the user: as root the sandbox's user has none of its own.
        processes = PROCESSES + (0 if os.geteuid() == 0 else _processes_of(os.geteuid()))
        env = {"PATH": PATH, "HOME": str(workdir), "LANG": "C.UTF-8"} if self.backend == "rlimits" else {"PATH": PATH}
        proc = subprocess.Popen(self._argv(command, workdir), cwd=workdir, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=lambda: self._preexec(processes),
                                start_new_session=True)
        assert proc.stdout is not None
        tail, total, capped = bytearray(), 0, threading.Event()

        def read() -> None:
            nonlocal total
            assert proc.stdout is not None
            while chunk := os.read(proc.stdout.fileno(), 65536):
                total += len(chunk)
                tail.extend(chunk)
                del tail[:-4 * RESULT_CHARS]
                if total > OUTPUT_KILL_BYTES:
                    capped.set()
                    _kill(proc)
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        timed_out = False
        try:
            proc.wait(timeout=WALL_S)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill(proc)
            proc.wait()
        _kill(proc)  # what the shell left running in the background (rlimits: same process group)
        reader.join(timeout=5)
        text = tail.decode("utf-8", "replace")
        truncated = total > len(tail) or len(text) > RESULT_CHARS
        text = text[-RESULT_CHARS:]
        code = proc.returncode
        sig = signal.Signals(-code).name if code is not None and code < 0 else None
        return ExecResult(command, None if (sig or timed_out or capped.is_set()) else code, text,
                          signal=None if timed_out or capped.is_set() else sig, timed_out=timed_out,
                          output_capped=capped.is_set(), truncated=truncated)


def _kill(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
