"""What the SGLang and vLLM engines share: a model server over HTTP, adapter versions on it, and
(optionally) the server process itself.

Adapter versions. The daemon names versions `v{N}`; on the server each load gets a name of its
own, `policy-v{N}-{engine id}-{load count}`, which is never used twice. SGLang re-loads an
unloaded name from its old path when a later request names it ("unload is not sticky"), and
vLLM keys its prefix cache by (name, path), so reusing a name could serve stale weights or
resurrect a retired version. A request is only ever routed to a name this engine has loaded
and not started to unload.

Swaps. Every request holds its version (an in-flight count) until it ends. `unload()` of a
version that is still in use only marks it retiring: no new request may use it, and the
server-side unload is sent in the background once its last request has finished, so the swap
itself never waits for streams to drain.

Supervision (supervisor.py): the server runs as a restarted child; after a restart the engine
loads every live version again under fresh names. With `engine_url` the engine attaches to a
server someone else runs and supervises nothing.
"""

from __future__ import annotations

import abc
import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx

from clawback.engine import EngineError, ModelInfo, Sampling, Token
from clawback.records import JsonObject

from .supervisor import ServerProcess, healthy

log = logging.getLogger(__name__)
T = TypeVar("T")


# ---------------------------------------------------------------------------------------------
# Adapter versions and routing.


@dataclass(eq=False)
class _Version:
    version: str  # the daemon's name, v{N}
    server_name: str  # the name on the server: unique, never reused
    path: str
    inflight: int = 0
    retiring: bool = False  # unload requested: no new requests; unloaded when inflight hits 0
    dead: bool = False  # its server is gone (restarted): never unload the name on the new one


@dataclass
class Endpoint:
    base_url: str
    api_key: str | None = None  # normal routes
    admin_api_key: str | None = None  # adapter routes (SGLang's --admin-api-key); default api_key
    headers: dict[str, str] = field(default_factory=dict)

    def auth(self, admin: bool = False) -> dict[str, str]:
        key = (self.admin_api_key or self.api_key) if admin else self.api_key
        return {"authorization": f"Bearer {key}"} if key else {}


class RemoteEngine(abc.ABC):
    """The Engine protocol over a model server. Subclasses speak its HTTP dialect:
    `_server_load`, `_server_unload`, `_stream`, `_score` and `_score_candidates`."""


    def __init__(self, info: ModelInfo, endpoint: Endpoint, server: ServerProcess | None = None,
                 name_prefix: str = "policy") -> None:
        self.info = info
        self.endpoint = endpoint
        self.server = server
        if server is not None:
            server.on_restart = self._reload_after_restart
        self._prefix = f"{name_prefix}-"
        self._engine_id = secrets.token_hex(3)  # a fresh engine never collides with an old one's names
        self._loads = 0
        self._versions: dict[str, _Version] = {}  # loaded (possibly retiring), by daemon name
        self._active: str | None = None
        self._unloads: set[asyncio.Task] = set()
        self._running = 0
        self.client = httpx.AsyncClient(base_url=endpoint.base_url, headers=endpoint.headers,
                                        timeout=httpx.Timeout(None, connect=10.0))

    async def start(self) -> None:
        """Start (or, attached, wait for) the server; check it serves the model."""
        if self.server is not None:
            await self.server.start()
            self._follow_server()
        else:
            deadline = time.monotonic() + 60
            while not await healthy(self.client, self.endpoint.base_url):
                if time.monotonic() > deadline:
                    raise EngineError(f"no healthy model server at {self.endpoint.base_url}")
                await asyncio.sleep(0.5)
        await self._check_server()

    def _follow_server(self) -> None:
        """The supervised server may have moved to another port (see ServerProcess._launch)."""
        if self.server is not None and self.server.base_url != self.endpoint.base_url:
            self.endpoint.base_url = self.server.base_url
            self.client.base_url = self.server.base_url

    async def _check_server(self) -> None:
        """Subclasses compare the server's model with ours."""

    # ---- Engine protocol ----

    async def generate(
        self, prompt_ids: Sequence[int], sampling: Sampling, adapter: str | None = None, *, background: bool = False
    ) -> AsyncGenerator[Token, None]:
        # `background` (the judge): both servers batch continuously, so background work costs
        # serving little; it is not prioritised separately.
        if not prompt_ids:
            raise EngineError("empty prompt")
        room = self.info.context_length - len(prompt_ids)
        if room <= 0:
            raise EngineError("the prompt fills the context")
        sampling = _fit(sampling, room)
        v = self._acquire(adapter, allow_retiring=False)
        self._running += 1
        try:
            async for tok in self._stream(list(prompt_ids), sampling, v.server_name if v else None):
                yield tok
        except httpx.HTTPError as e:
            raise EngineError(f"model server: {type(e).__name__}: {e}") from e
        finally:
            self._running -= 1
            self._release(v)

    async def score(
        self, prompt_ids: Sequence[int], response_ids: Sequence[int], adapter: str | None = None
    ) -> list[float]:
        if not response_ids:
            self._check_scoring(prompt_ids, response_ids)
            return []
        out = await self._scored(self._score, prompt_ids, response_ids, adapter)
        if len(out) != len(response_ids):
            raise EngineError(f"server returned {len(out)} logprobs for {len(response_ids)} tokens")
        return out

    async def score_candidates(
        self, prompt_ids: Sequence[int], response_ids: Sequence[int], candidates: Sequence[Sequence[int]],
        adapter: str | None = None,
    ) -> list[list[float]]:
        if len(candidates) != len(response_ids):
            raise EngineError(f"{len(candidates)} candidate rows for {len(response_ids)} response tokens")
        if not response_ids:
            self._check_scoring(prompt_ids, response_ids)
            return []
        rows = [list(map(int, row)) for row in candidates]
        out = await self._scored(lambda p, r, name: self._score_candidates(p, r, rows, name),
                                 prompt_ids, response_ids, adapter)
        if [len(row) for row in out] != [len(row) for row in rows]:
            raise EngineError("the server's candidate logprobs do not match the candidates asked for")
        return out

    def _check_scoring(self, prompt_ids: Sequence[int], response_ids: Sequence[int]) -> None:
        if not prompt_ids:
            raise EngineError("empty prompt")
        if len(prompt_ids) + len(response_ids) > self.info.context_length:
            raise EngineError("prompt + response exceed the context length")

    async def _scored(self, fn: Callable[[list[int], list[int], str | None], Awaitable[T]],
                      prompt_ids: Sequence[int], response_ids: Sequence[int], adapter: str | None) -> T:
        """`fn(prompt, response, server name)` on `adapter`'s version, held for the call (a retiring
        version is still on the server)."""
        self._check_scoring(prompt_ids, response_ids)
        v = self._acquire(adapter, allow_retiring=True)
        try:
            return await fn(list(prompt_ids), list(response_ids), v.server_name if v else None)
        except httpx.HTTPError as e:
            raise EngineError(f"model server: {type(e).__name__}: {e}") from e
        finally:
            self._release(v)

    async def load_adapter(self, version: str, path: str) -> None:
        v = self._versions.get(version)
        if v is not None:
            if v.retiring:  # rolled back before its unload went out: it is still on the server
                v.retiring = False
                return
            raise EngineError(f"adapter {version!r} is already loaded")
        if not (Path(path) / "adapter_config.json").is_file():
            raise EngineError(f"cannot read adapter {version!r} at {path}: no adapter_config.json")
        v = _Version(version, self._new_name(version), str(path))
        await self._load_checked(v)
        self._versions[version] = v

    async def activate(self, version: str | None) -> None:
        if version is not None:
            v = self._versions.get(version)
            if v is None or v.retiring:
                raise EngineError(f"adapter {version!r} is not loaded")
        self._active = version

    async def unload(self, version: str) -> None:
        if version == self._active:
            raise EngineError(f"adapter {version!r} is active; activate another first")
        v = self._versions.get(version)
        if v is None or v.retiring:
            raise EngineError(f"adapter {version!r} is not loaded")
        v.retiring = True
        if v.inflight == 0:
            await self._unload_now(v)
        # else: the last request using it sends the unload (see _release)

    def active_version(self) -> str | None:
        return self._active

    def loaded_versions(self) -> list[str]:
        return [name for name, v in self._versions.items() if not v.retiring]

    def server_names(self) -> dict[str, str]:
        """Daemon version -> the name it has on the server (tests and status)."""
        return {name: v.server_name for name, v in self._versions.items()}

    def running(self) -> int:
        return self._running

    async def close(self) -> None:
        for task in list(self._unloads):
            task.cancel()
        await asyncio.gather(*self._unloads, return_exceptions=True)
        await self.client.aclose()
        if self.server is not None:
            await self.server.stop()

    # ---- versions ----

    def _new_name(self, version: str) -> str:
        self._loads += 1
        return f"{self._prefix}{version}-{self._engine_id}-{self._loads}"

    def _acquire(self, adapter: str | None, allow_retiring: bool) -> _Version | None:
        if adapter is None:
            return None
        v = self._versions.get(adapter)
        if v is None or (v.retiring and not allow_retiring):
            raise EngineError(f"adapter {adapter!r} is not loaded")
        v.inflight += 1
        return v

    def _release(self, v: _Version | None) -> None:
        if v is None:
            return
        v.inflight -= 1
        if v.retiring and v.inflight == 0 and not v.dead:
            task = asyncio.create_task(self._unload_now(v, background=True))
            self._unloads.add(task)
            task.add_done_callback(self._unloads.discard)

    async def _unload_now(self, v: _Version, background: bool = False) -> None:
        # Forget the name first: from here on nothing can route to it, and a rollback loads the
        # version again under a new name.
        if self._versions.get(v.version) is v:
            del self._versions[v.version]
        try:
            await self._server_unload(v.server_name)
            log.info("unloaded %s (%s)", v.version, v.server_name)
        except (EngineError, httpx.HTTPError) as e:
            if not background:
                raise EngineError(f"unloading {v.version!r}: {e}") from e
            log.warning("unloading %s (%s) failed: %s", v.version, v.server_name, e)

    async def _load_checked(self, v: _Version) -> None:
        try:
            await self._server_load(v.server_name, v.path)
        except httpx.HTTPError as e:
            raise EngineError(f"loading adapter {v.version!r}: {type(e).__name__}: {e}") from e
        log.info("loaded %s as %s from %s", v.version, v.server_name, v.path)

    async def _reload_after_restart(self) -> None:
        """A restarted server has no adapters: load every live version again under new names.
        Requests that were running died with the old server; their versions are marked dead so
        that finishing them does not unload anything on the new one."""
        self._follow_server()
        old = self._versions
        self._versions = {}
        for name, v in old.items():
            v.dead = True
            if v.retiring:
                continue
            fresh = _Version(name, self._new_name(name), v.path)
            try:
                await self._load_checked(fresh)
            except EngineError as e:
                log.error("after the restart, %s could not be loaded again: %s", name, e)
                continue
            self._versions[name] = fresh
        if self._active is not None and self._active not in self._versions:
            log.error("after the restart the active adapter %s is gone: serving the base model", self._active)
            self._active = None

    # ---- the server's dialect (subclasses) ----

    @abc.abstractmethod
    async def _server_load(self, server_name: str, path: str) -> None:
        """Implemented by each server's engine (sglang.py, vllm.py)."""

    @abc.abstractmethod
    async def _server_unload(self, server_name: str) -> None:
        """Implemented by each server's engine (sglang.py, vllm.py)."""

    @abc.abstractmethod
    def _stream(self, prompt_ids: list[int], sampling: Sampling, server_name: str | None) -> AsyncIterator[Token]:
        """Implemented by each server's engine (sglang.py, vllm.py)."""

    @abc.abstractmethod
    async def _score(self, prompt_ids: list[int], response_ids: list[int], server_name: str | None) -> list[float]:
        """Implemented by each server's engine (sglang.py, vllm.py)."""

    @abc.abstractmethod
    async def _score_candidates(self, prompt_ids: list[int], response_ids: list[int], candidates: list[list[int]],
                                server_name: str | None) -> list[list[float]]:
        """Implemented by each server's engine (sglang.py, vllm.py)."""

    # ---- HTTP helpers ----

    async def _post_json(self, path: str, body: JsonObject, admin: bool = False) -> Any:
        # Any: the server's JSON (or its text when it sent none), which the caller knows the shape of
        r = await self.client.post(path, json=body, headers=self.endpoint.auth(admin))
        if r.status_code >= 400:
            raise EngineError(f"{path}: HTTP {r.status_code}: {_error_text(r)}")
        try:
            return r.json()
        except ValueError:
            return r.text

    async def _sse(self, path: str, body: JsonObject) -> AsyncIterator[JsonObject]:
        """POST and yield each `data:` JSON event until [DONE]. Leaving early closes the
        connection, which makes the server abort the generation."""
        async with self.client.stream("POST", path, json=body, headers=self.endpoint.auth()) as r:
            if r.status_code >= 400:
                await r.aread()
                raise EngineError(f"{path}: HTTP {r.status_code}: {_error_text(r)}")
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                event = json.loads(data)
                if isinstance(event, dict) and "error" in event:
                    err = event["error"]
                    raise EngineError(f"{path}: {err.get('message', err) if isinstance(err, dict) else err}")
                yield event


def _fit(sampling: Sampling, room: int) -> Sampling:
    """Servers reject prompt + max_tokens beyond the context; the embedded engine stops at it."""
    if sampling.max_tokens <= room:
        return sampling
    from dataclasses import replace

    return replace(sampling, max_tokens=room)


def _error_text(r: httpx.Response) -> str:
    try:
        body = r.json()
    except ValueError:
        return r.text[:500]
    if isinstance(body, dict):
        for key in ("error_message", "message", "detail"):
            if body.get(key):
                return str(body[key])
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
    return json.dumps(body)[:500]
