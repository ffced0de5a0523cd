"""Inference engines behind one interface (`clawback.engine.Engine`): embedded, vllm, sglang."""

from __future__ import annotations

from pathlib import Path

from clawback.engine import Engine, EngineConfig, read_model_info


def build_engine(config: EngineConfig, model_dir: str, torch_threads: int = 0) -> Engine:
    """The engine `config` asks for; `await engine.start()` (the daemon's lifespan
    does it) launches or reaches a vLLM / SGLang server, sized for the LoRA the trainer trains."""
    name = Path(model_dir).name
    if config.kind == "embedded":
        from .embedded import EmbeddedEngine

        return EmbeddedEngine(model_dir, device=config.device, dtype=config.dtype, name=name,
                              torch_threads=torch_threads or config.torch_threads)
    info = read_model_info(model_dir, name)
    if config.kind == "vllm":
        from .vllm import build_vllm_engine

        return build_vllm_engine(config, str(model_dir), info)
    if config.kind == "sglang":
        from .sglang import build_sglang_engine

        return build_sglang_engine(config, str(model_dir), info)
    raise ValueError(f"unknown engine {config.kind!r}")
