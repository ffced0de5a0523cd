"""Fixtures for the model-server engines: an event loop in a thread that outlives single tests
(so one server can serve a whole module), adapters in PEFT format, and a head_dim-64 tiny
model."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import torch

from tests.conftest import make_tiny_llama


class LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-loop", daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 600):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def loop():
    lt = LoopThread()
    yield lt
    lt.close()


def make_adapters(model_dir: Path, out_root: Path, n: int = 2, rank: int = 4) -> dict[str, Path]:
    """Random LoRA adapters (non-zero B, so they change the outputs), each in its own dir,
    targeting the short module names as the trainer does."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from clawback.adapter_format import lora_target_modules

    targets = lora_target_modules(model_dir)

    out = {}
    for i in range(n):
        name = f"v{i + 1}"
        torch.manual_seed(100 + i)
        base = AutoModelForCausalLM.from_pretrained(str(model_dir))
        cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False)
        model = get_peft_model(base, cfg)
        path = out_root / f"adapter-{name}"
        model.save_pretrained(str(path))
        out[name] = path
    return out


@pytest.fixture(scope="module")
def hd64_model_dir(embedded_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """head_dim 64: vLLM's CPU attention supports it, not the 8 of the default tiny model (reference §7)."""
    return make_tiny_llama(embedded_model_dir, tmp_path_factory.mktemp("tiny-llama-hd64"), hidden_size=128,
                           intermediate_size=256, num_attention_heads=2, num_key_value_heads=2, head_dim=64)
