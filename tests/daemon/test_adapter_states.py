"""The adapter versions' state machine (live, retired, refused, pruned; restore after a restart),
with a real store and real version directories but no model, so it runs in the fast tier.

`Slots` stands in for the engine: what is under test is which version the manager asks
to serve and what the store records, not loading weights; `test_adapters.py` (slow tier) runs the
same path on a real embedded engine."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

from clawback.adapter_format import CONFIG, META, OPTIMIZER, WEIGHTS, install
from clawback.daemon.adapters import AdapterError, AdapterManager
from clawback.daemon.store import Store
from clawback.records import StepRecord
from tests.daemon.engine_slots import Slots


def version_files(version: int) -> dict[str, bytes]:
    """A valid version as `read_files` would send it: a one-tensor LoRA, an empty optimizer state."""
    optimizer = io.BytesIO()
    torch.save({}, optimizer)
    files = {CONFIG: json.dumps({"peft_type": "LORA", "r": 2}).encode(),
             WEIGHTS: save({"layers.0.q_proj.lora_A.weight": torch.full((2, 4), 0.1 * version)}),
             OPTIMIZER: optimizer.getvalue()}
    meta = {"version": version, "files": {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}}
    return {**files, META: json.dumps(meta).encode()}


@pytest.fixture
def setup(tmp_path: Path):
    root, store = tmp_path / "adapters", Store(tmp_path / "db.sqlite")
    for v in (1, 2, 3):
        path = install(root, v, version_files(v))
        asyncio.run(store.record_step(StepRecord(version=v, parent=v - 1 or None, started_at=time.time(),
                                                 method="binary", call_ids=(), outcome="committed", path=str(path))))
    engine = Slots()
    yield AdapterManager(engine, store, root, keep=2), engine, store, root  # type: ignore[arg-type]  # the engine's adapter half
    store.close()


def states(store: Store) -> dict[int, str]:
    return {a.version: a.state for a in store.adapters()}


def test_refused_and_rolled_back_from_versions_serve_only_when_forced_and_never_after_a_restart(setup):
    """A refused version promoted by hand is refused again once it leaves; a rollback to it, or to
    a version rolled back from, needs force and says why; a restart whose live version cannot load
    falls back to neither."""
    manager, engine, store, root = setup

    async def go():
        await manager.go_live(1, str(root / "v1"))
        await manager.go_live(2, str(root / "v2"))
        await manager.refuse(3, "collapse: the same reply everywhere", {"collapse": True})
        await manager.promote(3)
        await manager.rollback(2)
        assert states(store) == {1: "committed", 2: "live", 3: "refused"}
        with pytest.raises(AdapterError, match="v3 was refused: collapse.*--force"):
            await manager.rollback(3)
        await manager.rollback(1)
        with pytest.raises(AdapterError, match="v2 was rolled back from.*--force"):
            await manager.rollback(2)
        assert manager.live() == 1
        await manager.rollback(2, force=True)
        assert manager.live() == 2 and states(store)[1] == "committed"
        await manager.rollback(1)

    asyncio.run(go())
    assert states(store) == {1: "live", 2: "retired", 3: "refused"}
    assert engine.loaded == ["v1"]  # every version that left was unloaded
    weights = root / "v1" / WEIGHTS
    weights.write_bytes(weights.read_bytes()[:100])  # the live version no longer loads
    restarted = Slots()
    assert asyncio.run(AdapterManager(restarted, store, root, keep=2).restore()) is None  # type: ignore[arg-type]
    assert restarted.active is None and restarted.loaded == []  # the base model, not v2 or v3


def test_a_corrupt_version_is_never_activated(setup):
    manager, engine, store, root = setup
    asyncio.run(manager.go_live(1, str(root / "v1")))
    weights = root / "v2" / WEIGHTS
    weights.write_bytes(weights.read_bytes()[:100])  # truncated on disk
    with pytest.raises(AdapterError, match="v2 failed to load"):
        asyncio.run(manager.go_live(2, str(root / "v2")))
    assert manager.live() == 1 and engine.loaded == ["v1"]
    assert states(store)[2] == "committed"


def test_retention_keeps_newest_pinned_and_live(setup):
    manager, engine, store, root = setup

    async def go():
        await manager.go_live(1, str(root / "v1"))
        await manager.pin(2)
        return await manager.prune()

    # keep=2 keeps v3 and v2 (newest); v1 is live; nothing else exists
    assert asyncio.run(go()) == []
    asyncio.run(manager.pin(2, False))
    asyncio.run(manager.rollback(3))
    assert asyncio.run(manager.prune()) == [1]
    assert not (root / "v1").exists() and states(store)[1] == "pruned"
    with pytest.raises(AdapterError, match="v1 is pruned"):
        asyncio.run(manager.rollback(1))


def test_restore_removes_half_written_and_unrecorded_versions(setup):
    """A crash mid-install leaves `.vN.*.tmp`; one between install and the step's commit leaves a
    complete `vN` the store never recorded: nothing may serve either."""
    manager, engine, store, root = setup
    (root / ".v4.x1y2.tmp").mkdir()
    (root / ".v4.x1y2.tmp" / CONFIG).write_text("{}")
    shutil.copytree(root / "v3", root / "v5")
    asyncio.run(manager.restore())
    assert sorted(p.name for p in root.iterdir()) == ["v1", "v2", "v3"]
    assert manager.live() == 3 and engine.active == "v3"
    assert manager.next_version() == 4
