"""Adapter versions on the serving side: load, go live, roll back, pin, prune.

A version goes live in three steps: validate its files, load it into the engine next to the live
one, then route new requests to it (`activate`). Generations already running finish on the
version they started with; the old version is unloaded once they are done (the engine defers the
unload). A version that fails to validate or load is never activated, so the old one keeps serving.
With the gate on (gate.py) a trained version waits loaded but inactive as a `candidate` until the
gate promotes it; a `refused` one stays on disk, and `promote` overrides the gate.
Engine names are `v{N}`; `None` is the base model.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from clawback.adapter_format import AdapterError as FileError
from clawback.adapter_format import install, read_files, validate, version_dir
from clawback.engine import Engine
from clawback.records import JsonObject, Version

from .store import Store
from .store.reads import AdapterRow

log = logging.getLogger(__name__)


class AdapterError(RuntimeError):
    pass


@dataclass(frozen=True)
class Promotion:
    """A version put live whatever the gate said, and what that overrode (the HTTP reply's fields)."""

    live: int
    swap_s: float
    previous_state: str
    overrides: str | None  # the refusal's reason; None: it was not refused


@dataclass(frozen=True)
class Taint:
    """The versions that carry forgotten samples, and the rollback to offer (None = the base model)."""

    affected_versions: list[int]
    rollback_to: int | None


class AdapterManager:
    def __init__(self, engine: Engine, store: Store, root: Path, keep: int,
                 on_live: Callable[[int | None], None] = lambda _: None) -> None:
        self.engine, self.store, self.root, self.keep = engine, store, Path(root), keep
        self.on_live = on_live  # told the version that serves now (None = base)
        self._lock = asyncio.Lock()  # one swap at a time
        self.last_swap_s: float | None = None

    def live(self) -> int | None:
        return Version.of(self.engine.active_version())

    def next_version(self) -> int:
        known = [a.version for a in self.store.adapters()]
        on_disk = [v for p in self.root.glob("v*") if (v := Version.match(p.name)) is not None]
        return max(known + on_disk, default=0) + 1

    async def restore(self) -> int | None:
        """After a restart, serve what was live: the base model if that was the last choice, else
        the live version, or when it cannot load the newest `committed` one before it; never one
        that was refused or rolled back from (`retired`), which only a person puts back."""
        await asyncio.to_thread(self._remove_leftovers)
        if await asyncio.to_thread(self.store.base_was_live):
            return None
        rows = await asyncio.to_thread(self.store.adapters)
        live = [a for a in rows if a.state == "live"]
        below = live[0].version if live else float("inf")
        candidates = live + sorted((a for a in rows if a.state == "committed" and a.version < below),
                                   key=lambda a: a.version, reverse=True)
        for a in candidates:
            try:
                await self.go_live(a.version, a.path)
                return a.version
            except AdapterError as e:
                log.error("cannot restore adapter v%d: %s", a.version, e)
        return None

    def _remove_leftovers(self) -> list[Path]:
        """Half-written versions (`.v{N}.*.tmp`, a crash during install) and complete ones the store
        never recorded (a crash between install and the step's commit): nothing may serve them."""
        recorded = {a.version for a in self.store.adapters()}
        doomed = [p for p in self.root.glob(".v*.tmp")]
        doomed += [p for p in self.root.glob("v*") if (v := Version.match(p.name)) is not None and v not in recorded]
        for p in doomed:
            log.warning("removing %s: no recorded adapter version", p)
            shutil.rmtree(p, ignore_errors=True)
        return doomed

    async def receive(self, version: int, files: dict[str, bytes]) -> str:
        """Commit a version the trainer sent as bytes into this host's adapters dir; its path."""
        try:
            return str(await asyncio.to_thread(install, self.root, version, files))
        except FileError as e:
            raise AdapterError(f"{Version(version).name} failed to install: {e}") from e

    async def files(self, version: int | None) -> dict[str, bytes] | None:
        """A version's files as bytes, for a trainer that must resume from it (None = base)."""
        return None if version is None else await asyncio.to_thread(read_files, version_dir(self.root, version))

    async def load(self, version: int, path: str) -> None:
        """Validate and load a version without routing anything to it."""
        name = Version.name_of(version)
        if name in self.engine.loaded_versions():
            return
        try:
            await asyncio.to_thread(validate, path)
            await self.engine.load_adapter(name, path)
        except (FileError, Exception) as e:
            raise AdapterError(f"{Version(version).name} failed to load: {e}") from e

    async def go_live(self, version: int | None, path: str | None = None) -> float:
        """Route new requests to `version` (None = base); returns the swap time in seconds."""
        async with self._lock:
            t0 = time.perf_counter()
            previous = self.engine.active_version()
            if version is not None:
                if path is None:
                    raise AdapterError(f"{Version(version).name}: no path")
                await self.load(version, path)
            await self.engine.activate(Version.name_of(version))
            await self.store.set_live(version)
            if previous is not None and previous != Version.name_of(version):
                await self.engine.unload(previous)  # deferred by the engine until its generations end
            self.last_swap_s = time.perf_counter() - t0
        self.on_live(version)
        return self.last_swap_s

    async def rollback(self, version: int | None, force: bool = False) -> float:
        """Serve `version` (None = base). A version the gate or guard refused, or one rolled back
        from (`retired`), is served only with `force`: the refusal says why; with force a refused
        or candidate version goes live as `promote` puts it (the gate overridden)."""
        if version is None:
            return await self.go_live(None)
        row = self._row(version)
        if row.state in ("failed", "pruned"):
            raise AdapterError(f"{Version(version).name} is {row.state} and cannot serve")
        if row.state in ("refused", "candidate", "retired") and not force:
            why = {"refused": f"was refused: {row.reason}", "candidate": "is a candidate the gate has not decided on",
                   "retired": "was rolled back from"}[row.state]
            gate = f", as `clawback adapters promote {version}` does" if row.state != "retired" else ""
            raise AdapterError(f"{Version(version).name} {why}; `clawback adapters rollback {version} --force` serves it anyway{gate}")
        if row.state in ("refused", "candidate"):
            return (await self.promote(version)).swap_s
        return await self.go_live(version, row.path)

    async def record_gate(self, version: int, report: JsonObject) -> None:
        """Add to the version's gate report (the gate's checks, the guard's counts)."""
        await self.store.update_adapter(version, gate={**self._row(version).gate, **report})

    async def refuse(self, version: int, reason: str, report: JsonObject) -> None:
        """Keep a version on disk but out of service: the gate or the live guard said no."""
        row = self._row(version)
        if self.live() == version and "promoted_by_hand" in row.gate:  # while under review
            await self.record_gate(version, {**report, "overridden": reason})
            return
        await self.store.update_adapter(version, state="refused", reason=reason, gate={**row.gate, **report})
        if Version.name_of(version) in getattr(self.engine, "loaded_versions", lambda: [])():
            await self.engine.unload(Version.name_of(version))

    async def promote(self, version: int) -> Promotion:
        """Put a version live whatever the gate said; returns what that overrides."""
        row = self._row(version)
        if row.state in ("failed", "pruned"):
            raise AdapterError(f"{Version(version).name} is {row.state} and cannot serve")
        overrides = row.reason if row.state == "refused" else None
        # The person decided: neither a pending review nor the live guard takes it back. Marked
        # before it serves, so a guard check already under way sees the mark before it rolls back.
        await self.record_gate(version, {"promoted_by_hand": time.time()})
        try:
            swap_s = await self.go_live(version, row.path)
        except BaseException:
            await self.store.update_adapter(version, gate=row.gate)  # it never served: no mark
            raise
        self.store.add_event("adapter.promoted", str(version), {"overrides": overrides, "previous_state": row.state})
        return Promotion(version, swap_s, row.state, overrides)

    async def pin(self, version: int, pinned: bool = True) -> None:
        self._row(version)
        await self.store.update_adapter(version, pinned=pinned)

    async def prune(self) -> list[int]:
        """Keep the newest `keep` good versions, the newest `keep` refused ones, pinned ones and the
        live one; delete the rest."""
        rows = await asyncio.to_thread(self.store.adapters)
        def newest(states: tuple[str, ...]) -> set[int]:
            found = sorted((a.version for a in rows if a.state in states), reverse=True)
            return set(found[: self.keep])

        # Refused versions are kept as long as good ones (the newest K), to inspect or promote.
        keep = newest(("committed", "retired", "live", "candidate")) | newest(("refused",))
        keep |= {a.version for a in rows if a.pinned}
        keep |= {self.live()} - {None}
        doomed = [a for a in rows if a.version not in keep and a.state != "pruned"]
        for a in doomed:
            await asyncio.to_thread(shutil.rmtree, a.path, True)
            await self.store.update_adapter(a.version, state="pruned")
        return [a.version for a in doomed]

    def _row(self, version: int) -> AdapterRow:
        for a in self.store.adapters():
            if a.version == version:
                return a
        raise AdapterError(f"no adapter version {version}")


def promoted_summary(out: JsonObject) -> str:
    """What `AdapterManager.promote` did, from its HTTP reply, in words: the CLI prints it, the
    dashboard shows it."""
    overrides = out["overrides"] or f"nothing (it was {out['previous_state']})"
    return f"{Version(out['live']).name} is live; this overrides the gate: {overrides}"


def tainted_versions(rows: list[AdapterRow], trained: list[int]) -> Taint:
    """Versions that carry forgotten samples (trained on them, or descended from one that was),
    and the newest good version trained before the first of them (None = the base model): the
    rollback to offer."""
    parent = {a.version: a.parent for a in rows}
    hit = set(trained)

    def tainted(version: int | None) -> bool:
        while version is not None:
            if version in hit:
                return True
            version = parent.get(version)
        return False

    affected = sorted(a.version for a in rows if tainted(a.version))
    if not affected:
        return Taint([], None)
    clean = [a.version for a in rows if a.version < min(affected) and not tainted(a.version)
             and a.state in ("committed", "live")]
    return Taint(affected, max(clean, default=None))
