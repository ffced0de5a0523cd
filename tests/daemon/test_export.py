"""`clawback export adapter vN --format peft|merged|gguf-lora|gguf-merged` on the embedded SmolLM2
model and a random (non-zero) LoRA version: every output loads, and all four carry the same adapter.

- peft and merged load with transformers/PEFT and give the same logits as the adapter on the base;
- the merged GGUF loads with transformers' GGUF reader and gives those logits too (F16 rounding);
- the GGUF LoRA is read with the `gguf` reader: llama.cpp tensor names, shapes, alpha, and
  base GGUF + B·A·alpha/r equals the merged GGUF's tensor (so llama.cpp applies the same change).
llama.cpp itself is not run: PyPI has no binary wheel of it for this machine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

PROMPT = [1, 520, 33, 4481, 28, 2, 198, 77, 9000]


@pytest.fixture(scope="module")
def data_dir(embedded_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from clawback.adapter_format import lora_target_modules

    root = tmp_path_factory.mktemp("export-data")
    torch.manual_seed(7)
    base = AutoModelForCausalLM.from_pretrained(str(embedded_model_dir))
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=lora_target_modules(embedded_model_dir), init_lora_weights=False)
    get_peft_model(base, cfg).save_pretrained(str(root / "adapters" / "v3"))
    (root / "models").mkdir()
    (root / "models" / embedded_model_dir.name).symlink_to(embedded_model_dir)  # no second conversion
    return root


def export(data_dir: Path, fmt: str, out: Path) -> Path:
    """In-process (the CLI's own path is run for gguf-merged, which also finds the base GGUF itself)."""
    from clawback.daemon.export import export_adapter

    return export_adapter(data_dir / "adapters" / "v3", str(data_dir / "models" / "smollm2-135m-instruct"), fmt, out)


def export_cli(data_dir: Path, fmt: str, out: Path) -> Path:
    cmd = [sys.executable, "-m", "clawback.cli", "export", "adapter", "v3", "--format", fmt, "--data-dir", str(data_dir), "--model", "smollm2-135m-instruct",
           "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"wrote {out}" in proc.stdout
    return out


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([PROMPT])).logits[0].float()


@pytest.fixture(scope="module")
def reference(embedded_model_dir: Path, data_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of the base model, and of the base with the adapter (PEFT, unmerged)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(embedded_model_dir))
    plain = logits(base)
    return plain, logits(PeftModel.from_pretrained(base, str(data_dir / "adapters" / "v3")))


def test_peft_and_merged_load_and_match(data_dir: Path, reference, tmp_path: Path, embedded_model_dir: Path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    plain, adapted = reference
    assert (plain - adapted).abs().max() > 0.1, "the adapter changes the outputs"
    peft_dir = export(data_dir, "peft", tmp_path / "peft")
    base = AutoModelForCausalLM.from_pretrained(str(embedded_model_dir))
    assert torch.allclose(logits(PeftModel.from_pretrained(base, str(peft_dir))), adapted, atol=1e-5)
    merged = export(data_dir, "merged", tmp_path / "merged")
    assert (merged / "tokenizer.json").is_file()
    assert torch.allclose(logits(AutoModelForCausalLM.from_pretrained(str(merged))), adapted, atol=1e-3)


def test_gguf_merged_and_lora_carry_the_adapter(data_dir: Path, reference, tmp_path: Path):
    import gguf
    from transformers import AutoModelForCausalLM

    from clawback.daemon.models import source_gguf

    plain, adapted = reference
    merged = export_cli(data_dir, "gguf-merged", tmp_path / "merged.gguf")
    lora = export(data_dir, "gguf-lora", tmp_path / "lora.gguf")

    model = AutoModelForCausalLM.from_pretrained(str(merged.parent), gguf_file=merged.name)
    got = logits(model)
    # Q4_1 base -> the embedded model was dequantized from the same GGUF; merged tensors are F16.
    assert (got - adapted).abs().max() < 0.15 < (got - plain).abs().max(), \
        ((got - adapted).abs().max(), (got - plain).abs().max())

    base, m, a = (gguf.GGUFReader(str(p)) for p in (source_gguf(data_dir / "models" / "smollm2-135m-instruct"), merged, lora))
    assert a.fields["general.type"].contents() == "adapter" and a.fields["adapter.type"].contents() == "lora"
    assert a.fields["adapter.lora.alpha"].contents() == 8.0
    base_tensors = {t.name: t for t in base.tensors}
    merged_tensors = {t.name: t for t in m.tensors}
    assert list(merged_tensors) == list(base_tensors)  # same names, same order
    pairs = {t.name for t in a.tensors}
    targets = {n.removesuffix(".lora_a") for n in pairs if n.endswith(".lora_a")}
    assert pairs == {f"{n}.lora_{x}" for n in targets for x in "ab"} and targets <= set(base_tensors)
    assert {n.split(".", 2)[2] for n in targets} == {f"{k}.weight" for k in
                                                    ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
    la = {t.name: t for t in a.tensors}
    for name in ("blk.0.attn_q.weight", "blk.5.attn_k.weight", "blk.29.ffn_down.weight"):
        A, B = np.asarray(la[f"{name}.lora_a"].data), np.asarray(la[f"{name}.lora_b"].data)
        out_dim, in_dim = (int(d) for d in reversed(base_tensors[name].shape))
        assert A.shape == (4, in_dim) and B.shape == (out_dim, 4)
        w0 = gguf.quants.dequantize(base_tensors[name].data, base_tensors[name].tensor_type)
        w1 = np.asarray(merged_tensors[name].data, dtype=np.float32)
        assert merged_tensors[name].tensor_type == gguf.GGMLQuantizationType.F16
        np.testing.assert_allclose(w0 + B @ A * (8 / 4), w1, atol=2e-3)
    untouched = "token_embd.weight"
    assert merged_tensors[untouched].tensor_type == base_tensors[untouched].tensor_type
    assert bytes(merged_tensors[untouched].data) == bytes(base_tensors[untouched].data)


def test_bad_requests_change_nothing(data_dir: Path, tmp_path: Path):
    run = lambda *a: subprocess.run([sys.executable, "-m", "clawback.cli", "export", *a, "--data-dir", str(data_dir),  # noqa: E731
                                     "--model", "smollm2-135m-instruct"],
                                    capture_output=True, text=True, timeout=300)
    missing = run("adapter", "v9", "--format", "peft", "--out", str(tmp_path / "x"))
    assert missing.returncode == 2 and "no adapter version v9" in missing.stderr
    (tmp_path / "taken").mkdir()
    taken = run("adapter", "v3", "--format", "peft", "--out", str(tmp_path / "taken"))
    assert taken.returncode == 2 and "exists" in taken.stderr and not any((tmp_path / "taken").iterdir())


def test_gguf_out_without_the_suffix_gets_it(data_dir: Path, tmp_path: Path):
    """llama.cpp and Ollama recognise a GGUF by its name: `--out NAME` writes NAME.gguf."""
    proc = subprocess.run([sys.executable, "-m", "clawback.cli", "export", "adapter", "v3", "--format", "gguf-lora",
                           "--data-dir", str(data_dir), "--model", "smollm2-135m-instruct", "--out", str(tmp_path / "mine")],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"wrote {tmp_path / 'mine.gguf'} " in proc.stdout
    assert (tmp_path / "mine.gguf").is_file() and not (tmp_path / "mine").exists()


def test_a_version_exports_onto_the_model_it_was_trained_on(data_dir: Path, tmp_path: Path):
    """The daemon's model may have changed since v3 was trained: export reads the base from the
    version's PEFT config, and never pulls or uses the configured model (an offline, empty wheel
    folder makes any pull fail at once)."""
    (tmp_path / "no-wheels").mkdir()
    out = tmp_path / "v3.gguf"
    proc = subprocess.run([sys.executable, "-m", "clawback.cli", "export", "adapter", "v3", "--format", "gguf-lora",
                           "--data-dir", str(data_dir), "--model", "qwen2.5-coder-0.5b-instruct", "--out", str(out)],
                          capture_output=True, text=True, timeout=900,
                          env={**os.environ, "CLAWBACK_MODEL_WHEELS": str(tmp_path / "no-wheels")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out.is_file() and "qwen" not in proc.stdout + proc.stderr
