"""A cell's progress on disk, so that a stopped grid goes on where it stopped, mid-cell.

A cell on the 0.5B model takes an hour or more on a laptop, longer than a sitting. Each cell works in
`<out>/.work/<scenario>/<method>/seed<k>/`: `data/` is the daemon's data dir, and after every
interaction, once the daemon has settled (nothing queued, no step or review running), `checkpoint/`
is replaced by a copy of it: the store (SQLite's online backup, so a consistent snapshot) and the
adapter versions (hard links: a committed version's files are never rewritten), with the harness's
own progress (`progress.json`: the curve, the interactions so far, what is next). A cell started
again with the same code stamp and settings restores the checkpoint into a fresh `data/` and goes on
with the next interaction; anything the daemon did after the checkpoint is discarded, and the
record lists the interactions at which it resumed. The daemon's own restart path (adapters.restore,
the store's sessions) does the rest. A finished cell's work dir is deleted.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from clawback.daemon.store import Store
from clawback.records import JsonObject

from .cell_file import Progress

PROGRESS = "progress.json"
T = TypeVar("T")


def new_progress() -> Progress:
    """A cell's progress before its first interaction."""
    return {"next": 0, "wall_s": 0.0, "resumed_at": [], "curve": [], "interactions": [], "evals": {},
            "base_eval_from": None, "probes": [], "probed_notes": []}


def fingerprint(*parts: object) -> str:
    """What must match for a checkpoint to be resumed: code stamp, settings, cell, model."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


class Checkpoint:
    def __init__(self, root: Path, key: str) -> None:
        self.root, self.key = root, key
        self.data_dir = root / "data"
        self._saved = root / "checkpoint"

    def restore(self) -> Progress | None:
        """The saved progress, with the data dir put back as it was then; None (and an empty data
        dir) when there is nothing to resume for this key."""
        progress = self._read()
        shutil.rmtree(self.data_dir, ignore_errors=True)
        self.data_dir.mkdir(parents=True)
        if progress is None:
            shutil.rmtree(self._saved, ignore_errors=True)
            return None
        _copy_state(self._saved, self.data_dir)
        run: Progress = progress["harness"]
        run["resumed_at"].append(run["next"])
        return run

    def save(self, store: Store, db_path: Path, run: Progress, next_i: int, started: float) -> None:
        """Snapshot the settled daemon (its store at `db_path`, its adapters) with the harness's
        progress `run`, the next interaction being `next_i`; `started`: when this process began."""
        store.flush()
        harness: Progress = {**run, "next": next_i, "wall_s": run["wall_s"] + time.time() - started}
        tmp = self.root / "checkpoint.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        _backup(db_path, tmp / db_path.name)
        if (self.data_dir / "adapters").is_dir():
            shutil.copytree(self.data_dir / "adapters", tmp / "adapters", copy_function=os.link)
        (tmp / PROGRESS).write_text(json.dumps({"key": self.key, "harness": harness}))
        old = self.root / "checkpoint.old"
        shutil.rmtree(old, ignore_errors=True)
        if self._saved.exists():
            self._saved.replace(old)
        tmp.replace(self._saved)  # from here on the new checkpoint is the one a restart finds
        shutil.rmtree(old, ignore_errors=True)

    def _read(self) -> JsonObject | None:
        """progress.json as saved: {"key": the fingerprint, "harness": the Progress}."""
        saved = self._saved
        if not saved.is_dir() and (self.root / "checkpoint.old").is_dir():
            saved = self.root / "checkpoint.old"  # stopped between the two renames of `save`
            saved.replace(self._saved)
        try:
            progress = json.loads((self._saved / PROGRESS).read_text())
        except (OSError, json.JSONDecodeError):
            return None
        return progress if progress.get("key") == self.key else None


def _backup(src: Path, dst: Path) -> None:
    source = sqlite3.connect(f"file:{src}?mode=ro", uri=True)
    target = sqlite3.connect(dst)
    try:
        source.backup(target)
    finally:
        target.close()
        source.close()


def _copy_state(saved: Path, data_dir: Path) -> None:
    for f in saved.iterdir():
        if f.is_dir():
            shutil.copytree(f, data_dir / f.name, copy_function=os.link)
        elif f.name != PROGRESS:
            shutil.copy2(f, data_dir / f.name)


async def cached_base(path: Path | None, key: str, cell: str,
                      compute: Callable[[int], Awaitable[T]]) -> tuple[T, str | None]:
    """The evaluation before the first interaction, from `path` when a cell with the same `key`
    kept it there, else `compute(0)` (kept for the next cell); with the cell it came from (None:
    computed here)."""
    if path is not None:
        try:
            cached = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            cached = {}
        if cached.get("key") == key:
            return cached["value"], cached["cell"]
    value = await compute(0)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"key": key, "cell": cell, "value": value}))
        tmp.replace(path)
    return value, None
