"""Adapter versions on the serving side, with a real engine (tiny Llama) and a real store; the state
machine's other paths run model-free in `test_adapter_states.py`."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch

from clawback.adapter_format import publish
from clawback.daemon.adapters import AdapterManager
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


def test_go_live_rollback_and_restore(setup, tiny_model_dir: Path):
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
    assert manager.live() == 3 and engine.active_version() == "v3"
    restarted = EmbeddedEngine(tiny_model_dir)
    try:
        assert asyncio.run(AdapterManager(restarted, store, root, keep=2).restore()) == 3
        assert restarted.active_version() == "v3"
    finally:
        asyncio.run(restarted.close())

