"""`clawback export adapter vN --format ...`: a trained version in the formats other servers load.

- `peft`: the PEFT adapter dir (vLLM, SGLang and PEFT load it unchanged).
- `merged`: the base model with the adapter merged in, a plain transformers model dir.
- `gguf-lora`: a llama.cpp LoRA adapter (`llama-server --lora`), in llama.cpp's adapter layout
  (`general.type = adapter`, `<tensor>.lora_a` / `.lora_b`, `adapter.lora.alpha`).
- `gguf-merged`: the base model's GGUF with the adapted tensors replaced by merged ones (what
  Ollama needs: it no longer creates LoRA adapters). Untouched tensors keep their quantized bytes;
  merged ones are written as F16. Needs the base model's GGUF: a catalogue model keeps the one it
  was converted from.

GGUF files are read and written with the `gguf` package (llama.cpp's own Python library), tensor
names come from its name map, and Llama-family q/k rows are permuted as llama.cpp's converter does.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from gguf import GGUFWriter

FORMATS = ("peft", "merged", "gguf-lora", "gguf-merged")
PEFT_FILES = ("adapter_config.json", "adapter_model.safetensors")
# transformers model_type -> llama.cpp architecture, and whether its converter permutes q/k rows
ARCHES = {"llama": ("LLAMA", True), "mistral": ("LLAMA", True), "qwen2": ("QWEN2", False), "qwen3": ("QWEN3", False)}


class ExportError(ValueError):
    pass


def export_adapter(adapter_dir: Path, model_dir: str, fmt: str, out: Path, base_gguf: Path | None = None) -> Path:
    if fmt not in FORMATS:
        raise ExportError(f"unknown format {fmt!r}; one of {', '.join(FORMATS)}")
    if not (adapter_dir / "adapter_config.json").is_file():
        raise ExportError(f"{adapter_dir} is not an adapter version (no adapter_config.json)")
    if out.exists():
        raise ExportError(f"{out} exists; choose another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "peft":
        out.mkdir()
        for name in PEFT_FILES:
            shutil.copyfile(adapter_dir / name, out / name)
    elif fmt == "merged":
        _merged(adapter_dir, model_dir, out)
    elif fmt == "gguf-lora":
        _gguf_lora(adapter_dir, model_dir, out)
    else:
        if base_gguf is None:
            raise ExportError("gguf-merged needs the base model's GGUF (--base-gguf); catalogue models keep theirs. "
                              "Or export --format merged and convert it with llama.cpp's convert_hf_to_gguf.py")
        _gguf_merged(adapter_dir, model_dir, base_gguf, out)
    return out


def _merged(adapter_dir: Path, model_dir: str, out: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    merged.save_pretrained(str(out), safe_serialization=True)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(str(out))


class _Lora:
    """The adapter's LoRA pairs by llama.cpp tensor name, in transformers (row = output) layout."""

    def __init__(self, adapter_dir: Path, model_dir: str) -> None:
        import gguf
        from safetensors.numpy import load_file
        from transformers import AutoConfig

        config = json.loads((adapter_dir / "adapter_config.json").read_text())
        if config.get("rank_pattern") or config.get("alpha_pattern") or config.get("use_dora"):
            raise ExportError("adapters with rank/alpha patterns or DoRA have no GGUF LoRA form")
        model = AutoConfig.from_pretrained(model_dir)
        if model.model_type not in ARCHES:
            raise ExportError(f"no GGUF mapping for model type {model.model_type!r} (known: {', '.join(ARCHES)})")
        arch_name, self.permute_qk = ARCHES[model.model_type]
        self.arch = getattr(gguf.MODEL_ARCH, arch_name)
        self.arch_name = gguf.MODEL_ARCH_NAMES[self.arch]
        self.n_head = model.num_attention_heads
        self.n_head_kv = getattr(model, "num_key_value_heads", None) or self.n_head
        self.rank = int(config["r"])
        alpha = float(config["lora_alpha"])
        # llama.cpp scales by alpha / rank; rsLoRA scales by alpha / sqrt(rank)
        self.alpha = alpha * math.sqrt(self.rank) if config.get("use_rslora") else alpha
        names = gguf.get_tensor_name_map(self.arch, model.num_hidden_layers)
        weights = load_file(str(adapter_dir / "adapter_model.safetensors"))
        self.pairs: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for key, a in weights.items():
            if ".lora_A." not in key:
                continue
            module = key.removeprefix("base_model.model.").split(".lora_A.")[0]
            name = names.get_name(module)
            if name is None:
                raise ExportError(f"no llama.cpp name for module {module!r}")
            b = weights[key.replace(".lora_A.", ".lora_B.")]
            self.pairs[name + ".weight"] = (a.astype(np.float32), self._gguf_rows(name, b.astype(np.float32)))

    def _gguf_rows(self, name: str, rows: np.ndarray) -> np.ndarray:
        """Output rows in llama.cpp's order: its converter permutes Llama q/k rows for its RoPE."""
        if not self.permute_qk or not name.endswith(("attn_q", "attn_k")):
            return rows
        heads = self.n_head if name.endswith("attn_q") else self.n_head_kv
        return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)

    def delta(self, name: str) -> np.ndarray:
        a, b = self.pairs[name]
        return (b @ a) * (self.alpha / self.rank)


def _gguf_lora(adapter_dir: Path, model_dir: str, out: Path) -> None:
    import gguf

    lora = _Lora(adapter_dir, model_dir)
    writer = gguf.GGUFWriter(str(out), lora.arch_name)
    writer.add_string(gguf.Keys.General.TYPE, gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, lora.alpha)
    for name, (a, b) in lora.pairs.items():
        writer.add_tensor(f"{name}.lora_a", a)
        writer.add_tensor(f"{name}.lora_b", b)
    _write(writer)


def _gguf_merged(adapter_dir: Path, model_dir: str, base_gguf: Path, out: Path) -> None:
    import gguf

    lora = _Lora(adapter_dir, model_dir)
    reader = gguf.GGUFReader(str(base_gguf))
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    if arch != lora.arch_name:
        raise ExportError(f"{base_gguf} is a {arch!r} model, the adapter's base is {lora.arch_name!r}")
    writer = gguf.GGUFWriter(str(out), arch)
    for field in reader.fields.values():  # every key but the ones GGUFWriter writes itself
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    missing = set(lora.pairs) - {t.name for t in reader.tensors}
    if missing:
        raise ExportError(f"{base_gguf} lacks the adapted tensors {sorted(missing)[:3]}: not this adapter's base")
    for t in reader.tensors:
        if t.name in lora.pairs:
            weight = gguf.quants.dequantize(t.data, t.tensor_type) + lora.delta(t.name)
            writer.add_tensor(t.name, weight.astype(np.float16))
        else:
            writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    _write(writer)


def _write(writer: GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
