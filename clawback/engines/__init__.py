"""Inference engines behind one interface (`clawback.engine.Engine`): embedded, vllm, sglang."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from clawback.engine import Engine, read_model_info


def build_engine(settings: Any, model_dir: str, torch_threads: int = 0) -> Engine:
    """The engine the daemon's `Settings` ask for; `await engine.start()` (the daemon's lifespan
    does it) launches or reaches a vLLM / SGLang server, sized for the LoRA the trainer trains."""
    name = Path(model_dir).name
    if settings.engine == "embedded":
        from .embedded import EmbeddedEngine

        return EmbeddedEngine(model_dir, device=settings.device, dtype=settings.dtype, name=name,
                              torch_threads=torch_threads or settings.torch_threads)
    info = read_model_info(model_dir, name)
    lora = settings.train_config()
    if settings.engine == "vllm":
        from .vllm import build_vllm_engine

        return build_vllm_engine(settings, str(model_dir), info, lora.lora_rank)
    if settings.engine == "sglang":
        from .sglang import build_sglang_engine

        return build_sglang_engine(settings, str(model_dir), info, lora.lora_rank, lora.target_modules)
    raise ValueError(f"unknown engine {settings.engine!r}")
