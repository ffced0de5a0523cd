"""Adapter versions on the serving side, with a real engine (tiny Llama) and a real store."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch

from clawback.adapter_format import publish
from clawback.daemon.adapters import AdapterError, AdapterManager
from clawback.daemon.store import Store
from clawback.engines.embedded import EmbeddedEngine
from clawback.records import StepRecord
from clawback.trainer.config import TrainConfig
from clawback.trainer.step import make_lora_model, make_optimizer


@pytest.fixture
def setup(tiny_model_dir: Path, tmp_path: Path):
    from transformers import AutoModelForCausalLM

    root = tmp_path / "adapters"
    store = Store(tmp_path / "db.sqlite")
    cfg = TrainConfig(lora_rank=4, lora_alpha=8)
    for v in (1, 2, 3):
        model = make_lora_model(AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)), cfg)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1 * v)
        path = publish(root, v, model, make_optimizer(model, cfg), {"method": "binary"})
        asyncio.run(store.record_step(StepRecord(version=v, parent=v - 1 or None, started_at=time.time(),
                                                 method="binary", call_ids=(), outcome="committed", path=str(path))))
    engine = EmbeddedEngine(tiny_model_dir)
    yield AdapterManager(engine, store, root, keep=2), engine, store, root
    asyncio.run(engine.close())
    store.close()


def states(store: Store) -> dict[int, str]:
    return {a.version: a.state for a in store.adapters()}


def test_go_live_rollback_and_restore(setup):
    manager, engine, store, root = setup

    async def go():
        await manager.go_live(1, str(root / "v1"))
        await manager.go_live(2, str(root / "v2"))
        assert manager.live() == 2 and states(store) == {1: "committed", 2: "live", 3: "committed"}  # replaced
        await manager.rollback(1)
        assert manager.live() == 1 and states(store)[2] == "retired"  # rolled back from
        await manager.rollback(None)
        assert manager.live() is None and "live" not in states(store).values()
        await manager.rollback(3)

    asyncio.run(go())
    assert manager.live() == 3


def test_refused_and_rolled_back_from_versions_serve_only_when_forced_and_never_after_a_restart(
        setup, tiny_model_dir: Path):
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
    weights = root / "v1" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # the live version no longer loads
    restarted = EmbeddedEngine(tiny_model_dir)
    try:
        assert asyncio.run(AdapterManager(restarted, store, root, keep=2).restore()) is None
        assert restarted.active_version() is None  # the base model, not v2 or v3
    finally:
        asyncio.run(restarted.close())


def test_a_corrupt_version_is_never_activated(setup):
    manager, engine, store, root = setup
    asyncio.run(manager.go_live(1, str(root / "v1")))
    weights = root / "v2" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated on disk
    with pytest.raises(AdapterError):
        asyncio.run(manager.go_live(2, str(root / "v2")))
    assert manager.live() == 1 and engine.active_version() == "v1"
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
    with pytest.raises(AdapterError):
        asyncio.run(manager.rollback(1))


def test_restore_removes_half_written_and_unrecorded_versions(setup):
    """A crash mid-install leaves `.vN.*.tmp`; one between install and the step's commit leaves a
    complete `vN` the store never recorded. Neither was ever cleaned up."""
    import shutil

    manager, engine, store, root = setup
    (root / ".v4.x1y2.tmp").mkdir()
    (root / ".v4.x1y2.tmp" / "adapter_config.json").write_text("{}")
    shutil.copytree(root / "v3", root / "v5")
    asyncio.run(manager.restore())
    assert sorted(p.name for p in root.iterdir()) == ["v1", "v2", "v3"]
    assert manager.live() == 3
