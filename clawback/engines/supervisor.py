"""A model server (vLLM, SGLang) as a supervised child process.

`ServerProcess` starts the server in its own process group, waits for `/health`, restarts it
with backoff when it dies or stays unhealthy (then calls `on_restart`, so that the engine can
load its adapters again), and stops the whole group with the daemon, by PID, never by name.

Secrets: the server's API keys reach it through its arguments or environment; nothing here logs
them, and the child's own output (vLLM and SGLang print their arguments) is copied to its log
file with the keys masked.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import httpx

from clawback.engine import EngineError

log = logging.getLogger(__name__)


class ServerProcess:
    """A model server as a supervised child: own process group, health-checked, restarted."""

    def __init__(
        self,
        command: list[str],
        env: dict[str, str],
        base_url: str,
        log_path: Path,
        secrets_to_mask: Sequence[str] = (),
        start_timeout_s: float = 600.0,
        health_interval_s: float = 2.0,
        unhealthy_after_s: float = 60.0,
        max_backoff_s: float = 30.0,
        on_restart: Callable[[], Awaitable[object]] | None = None,
        auto_port: bool = False,
    ) -> None:
        self.command, self.env, self.base_url, self.log_path = command, env, base_url, Path(log_path)
        self._mask = [s for s in secrets_to_mask if s]
        self.start_timeout_s, self.health_interval_s = start_timeout_s, health_interval_s
        self.unhealthy_after_s, self.max_backoff_s = unhealthy_after_s, max_backoff_s
        self.on_restart = on_restart
        self.auto_port = auto_port  # the port after --port was picked by us and may be re-picked
        self.proc: subprocess.Popen | None = None
        self._log_copier: threading.Thread | None = None
        self.restarts = 0
        self._monitor: asyncio.Task | None = None
        self._stopping = False

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def redacted_command(self) -> str:
        return " ".join(self._masked(part) for part in self.command)

    def _masked(self, text: str) -> str:
        for s in self._mask:
            text = text.replace(s, "***")
        return text

    async def start(self) -> None:
        await self._launch()
        self._monitor = asyncio.create_task(self._watch(), name="engine-supervisor")

    async def _launch(self) -> None:
        """Start the child; with an auto-picked port, pick another when someone took it
        between our pick and the server's bind (other processes pick free ports too)."""
        for attempt in range(3):
            try:
                return await self._launch_once()
            except EngineError as e:
                taken = "address already in use" in str(e).lower()
                if not (self.auto_port and taken and attempt < 2):
                    raise
                self._rebind(free_port())
                log.warning("model server port was taken: retrying on %s", self.base_url)
        return None

    def _rebind(self, port: int) -> None:
        i = self.command.index("--port")
        self.command[i + 1] = str(port)
        self.base_url = f"http://127.0.0.1:{port}"

    async def _launch_once(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log.info("starting model server: %s (log: %s)", self.redacted_command(), self.log_path)
        # Own session/process group: stop() signals the whole group (vLLM and SGLang fork
        # workers), and a Ctrl-C in the daemon's terminal reaches the daemon, which stops it.
        self.proc = subprocess.Popen(
            self.command, env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent,
        )
        self._log_copier = threading.Thread(target=self._copy_output, args=(self.proc,), daemon=True,
                                            name=f"engine-log-{self.proc.pid}")
        self._log_copier.start()
        await self._wait_healthy(self.proc)

    def _copy_output(self, proc: subprocess.Popen) -> None:
        """Child output -> log file, secrets masked. Runs until the child closes its stdout."""
        assert proc.stdout is not None
        with self.log_path.open("a", encoding="utf-8", errors="replace") as out:
            for raw in proc.stdout:
                out.write(self._masked(raw.decode("utf-8", errors="replace")))
                out.flush()

    async def _wait_healthy(self, proc: subprocess.Popen) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        async with httpx.AsyncClient(timeout=5) as client:
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    if self._log_copier is not None:  # its last words are the error
                        await asyncio.to_thread(self._log_copier.join, 5)
                    raise EngineError(f"model server exited with code {proc.returncode} while starting; "
                                      f"see {self.log_path}:\n{self.log_tail()}")
                if await healthy(client, self.base_url):
                    log.info("model server ready at %s (pid %d)", self.base_url, proc.pid)
                    return
                await asyncio.sleep(0.5)
        await self._kill(proc)
        raise EngineError(f"model server not healthy after {self.start_timeout_s:.0f} s; see {self.log_path}")

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    async def _watch(self) -> None:
        """Restart the server when it exits or stays unhealthy; back off 1, 2, 4 ... s between
        restarts, back to 1 s once a restarted server has stayed up for `unhealthy_after_s`."""
        backoff = 1.0
        unhealthy_since: float | None = None
        up_since = time.monotonic()
        async with httpx.AsyncClient(timeout=10) as client:
            while not self._stopping:
                await asyncio.sleep(self.health_interval_s)
                proc = self.proc
                assert proc is not None
                if proc.poll() is None:
                    if await healthy(client, self.base_url):
                        unhealthy_since = None
                        if time.monotonic() - up_since > self.unhealthy_after_s:
                            backoff = 1.0
                        continue
                    unhealthy_since = unhealthy_since or time.monotonic()
                    if time.monotonic() - unhealthy_since < self.unhealthy_after_s:
                        continue
                    log.error("model server unhealthy for %.0f s: restarting it", self.unhealthy_after_s)
                    await self._kill(proc)
                else:
                    log.error("model server exited with code %s: restarting it in %.0f s",
                              proc.returncode, backoff)
                if self._stopping:
                    return
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.max_backoff_s)
                unhealthy_since = None
                try:
                    await self._launch()
                except EngineError as e:
                    log.error("model server restart failed: %s", e)
                    continue
                self.restarts += 1
                up_since = time.monotonic()
                if self.on_restart is not None:
                    try:
                        await self.on_restart()
                    except Exception:
                        log.exception("re-registering adapters after the restart failed")

    async def stop(self, timeout: float = 30.0) -> None:
        self._stopping = True
        if self._monitor is not None:
            self._monitor.cancel()
            await asyncio.gather(self._monitor, return_exceptions=True)
        if self.proc is not None:
            await self._kill(self.proc, timeout)

    async def _kill(self, proc: subprocess.Popen, timeout: float = 30.0) -> None:
        """SIGTERM to the child's process group, SIGKILL if it lingers."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)  # the group id is the child's pid (start_new_session)
            try:
                await asyncio.to_thread(proc.wait, timeout)
                if sig == signal.SIGTERM:  # give the group's other members the same signal's chance
                    _killpg_quietly(proc.pid, signal.SIGKILL)
                return
            except subprocess.TimeoutExpired:
                log.warning("model server (pid %d) ignored SIGTERM for %.0f s: killing it", proc.pid, timeout)


def _killpg_quietly(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM if the daemon dies without stopping us (Linux)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


async def healthy(client: httpx.AsyncClient, base_url: str) -> bool:
    try:
        return (await client.get(f"{base_url}/health")).status_code == 200
    except httpx.HTTPError:
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

