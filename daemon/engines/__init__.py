"""Inference engines behind one interface (see base.py): embedded, vllm, sglang."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def build_engine(settings: Any, model_dir: str) -> Any:
    """The engine the settings ask for. vLLM and SGLang engines still need `await engine.start()`
    (the daemon's lifespan does it) to launch or reach their server."""
    name = Path(model_dir).name
    if settings.engine == "embedded":
        from .embedded import EmbeddedEngine

        return EmbeddedEngine(model_dir, device=settings.device, dtype=settings.dtype, name=name,
                              torch_threads=settings.torch_threads)
    from clawback.engine import read_model_info

    info = read_model_info(model_dir, name)
    if settings.engine == "vllm":
        from .vllm import build_vllm_engine

        return build_vllm_engine(settings, str(model_dir), info)
    if settings.engine == "sglang":
        from .sglang import build_sglang_engine

        return build_sglang_engine(settings, str(model_dir), info)
    raise ValueError(f"unknown engine {settings.engine!r}")
