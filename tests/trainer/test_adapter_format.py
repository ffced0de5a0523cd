"""Publishing adapter versions: PEFT-format output the engine serves, atomic commits, validation,
and resuming model + optimizer."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from clawback import adapter_format as adapters
from clawback.adapter_format import AdapterError, install, list_versions, publish, read_files, resume, validate
from clawback.trainer.config import TrainConfig
from clawback.trainer.step import Sample, make_lora_model, make_optimizer, train_step

CFG = TrainConfig(lora_rank=4, lora_alpha=8, lr=1e-2)
PROMPT, RESPONSE = [1, 520, 33, 4481, 28], [9000, 77, 198, 2]



def samples(seed: int, n: int = 4) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    return [
        Sample(
            prompt_ids=torch.randint(3, 49152, (5,), generator=g).tolist(),
            response_ids=torch.randint(3, 49152, (4,), generator=g).tolist(),
            behaviour_logprobs=(-10 + torch.randn(4, generator=g)).tolist(),
            reward=1.0 if i % 2 else -1.0,
        )
        for i in range(n)
    ]


def fresh(model_dir: Path, cfg: TrainConfig = CFG):
    model = make_lora_model(AutoModelForCausalLM.from_pretrained(str(model_dir)), cfg)
    return model, make_optimizer(model, cfg)


def trained(model_dir: Path, steps: int = 2):
    model, opt = fresh(model_dir)
    for i in range(steps):
        metrics = train_step(model, opt, samples(i), CFG)
    return model, opt, metrics


def meta(metrics: dict, parent: int | None) -> dict:
    return {"parent": parent, "method": CFG.method, "samples": 4, "loss": metrics["loss"],
            "reward_mean": metrics["reward_mean"], "step_time_s": metrics["step_time_s"]}


@torch.no_grad()
def logits(model) -> torch.Tensor:
    return model(input_ids=torch.tensor([PROMPT + RESPONSE])).logits


def lora_weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad}


@pytest.fixture(scope="module")
def v1(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """A trained model, its optimizer, and its adapter published as <root>/v1."""
    model, opt, metrics = trained(tiny_model_dir)
    root = tmp_path_factory.mktemp("adapters")
    path = publish(root, 1, model, opt, meta(metrics, parent=None))
    return model, opt, path


def test_publish_writes_a_peft_adapter_that_reproduces_the_model(tiny_model_dir: Path, v1):
    from peft import PeftModel

    model, _, path = v1
    assert path.name == "v1"
    for name in ("adapter_config.json", "adapter_model.safetensors", "optimizer.pt", "clawback.json"):
        assert (path / name).is_file(), name
    info = validate(path)
    assert (info["version"], info["parent"], info["method"], info["samples"]) == (1, None, "combined", 4)
    config = json.loads((path / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["use_dora"], config["use_rslora"]) == (4, 8, False, False)
    assert "lm_head" not in config["target_modules"] and "q_proj" in config["target_modules"]

    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    base_logits = logits(base)
    loaded = PeftModel.from_pretrained(base, str(path)).eval()
    torch.testing.assert_close(logits(loaded), logits(model.eval()), atol=1e-6, rtol=0)
    assert (logits(loaded) - base_logits).abs().max() > 1e-3  # the adapter really changes the model


def test_embedded_engine_serves_the_published_adapter(tiny_model_dir: Path, v1):
    from clawback.engines.embedded import EmbeddedEngine

    model, _, path = v1
    engine = EmbeddedEngine(tiny_model_dir, device="cpu")

    async def go():
        try:
            base = await engine.score(PROMPT, RESPONSE)
            await engine.load_adapter("v1", str(path))
            return base, await engine.score(PROMPT, RESPONSE, adapter="v1")
        finally:
            await engine.close()

    base, adapted = asyncio.run(go())
    full = logits(model.eval())[0, len(PROMPT) - 1 : -1].log_softmax(-1)
    want = full.gather(-1, torch.tensor(RESPONSE)[:, None]).squeeze(-1).tolist()
    assert adapted == pytest.approx(want, abs=1e-4)  # served exactly as trained
    assert max(abs(a - b) for a, b in zip(adapted, base)) > 1e-3


def test_crash_before_the_rename_leaves_no_version_and_the_previous_one_intact(tiny_model_dir, v1, tmp_path, monkeypatch):
    model, opt, path = v1
    root = tmp_path / "adapters"
    shutil.copytree(path, root / "v1")
    before = {f.name: f.read_bytes() for f in (root / "v1").iterdir()}

    def crash(_path):
        raise OSError("disk gone")

    monkeypatch.setattr(adapters, "_fsync", crash)  # every file is written, nothing renamed yet
    with pytest.raises(OSError, match="disk gone"):
        publish(root, 2, model, opt, {"parent": 1})
    monkeypatch.undo()

    assert sorted(p.name for p in root.iterdir()) == ["v1"]  # no v2, no temp dir left behind
    assert {f.name: f.read_bytes() for f in (root / "v1").iterdir()} == before
    validate(root / "v1")

    # A hard kill gets no cleanup: its temp dir is invisible to readers and removed by resume.
    partial = root / ".v2.x1y2.tmp"
    partial.mkdir()
    (partial / "adapter_model.safetensors").write_bytes(b"\x00" * 10)
    assert list_versions(root) == [1]
    fresh_model, fresh_opt = fresh(tiny_model_dir)
    assert resume(fresh_model, fresh_opt, root)["version"] == 1
    assert not partial.exists()


def test_resume_restores_adapter_and_optimizer(tiny_model_dir: Path, v1, tmp_path):
    model, opt, path = v1
    root = path.parent
    restored, restored_opt = fresh(tiny_model_dir)
    assert resume(restored, restored_opt, tmp_path / "empty") is None
    info = resume(restored, restored_opt, root)
    assert info["version"] == 1

    want, got = lora_weights(model), lora_weights(restored)
    assert want.keys() == got.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=0, rtol=0)
    assert restored_opt.state_dict()["state"].keys() == opt.state_dict()["state"].keys()
    for i, state in opt.state_dict()["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(restored_opt.state_dict()["state"][i][key], value, atol=0, rtol=0)

    # The proof that the optimizer state matters: the next step is identical to an uninterrupted run.
    uninterrupted = make_lora_model(AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)), CFG)
    uninterrupted.load_state_dict(model.state_dict())
    cont_opt = make_optimizer(uninterrupted, CFG)
    cont_opt.load_state_dict(opt.state_dict())
    train_step(uninterrupted, cont_opt, samples(7), CFG)
    train_step(restored, restored_opt, samples(7), CFG)
    cold, cold_opt = fresh(tiny_model_dir)
    resume(cold, cold_opt, root)
    cold_opt = make_optimizer(cold, CFG)  # weights restored, AdamW moments lost
    train_step(cold, cold_opt, samples(7), CFG)
    a, b, c = lora_weights(uninterrupted), lora_weights(restored), lora_weights(cold)
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=1e-7, rtol=0)
    assert max((c[k] - a[k]).abs().max() for k in a) > 1e-4


def test_validator_rejects_corrupt_versions(v1, tmp_path: Path):
    _, _, path = v1

    def copy(name: str) -> Path:
        dst = tmp_path / name / "v1"
        shutil.copytree(path, dst)
        return dst

    truncated = copy("truncated")
    w = truncated / "adapter_model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    with pytest.raises(AdapterError, match="sha256"):
        validate(truncated)

    missing = copy("missing")
    (missing / "optimizer.pt").unlink()
    with pytest.raises(AdapterError, match="missing optimizer.pt"):
        validate(missing)

    bad_meta = copy("bad-meta")
    (bad_meta / "clawback.json").write_text("{not json")
    with pytest.raises(AdapterError, match="metadata"):
        validate(bad_meta)

    renamed = tmp_path / "renamed" / "v7"
    shutil.copytree(path, renamed)
    with pytest.raises(AdapterError, match="version"):
        validate(renamed)


def test_resume_falls_back_past_a_corrupt_latest_version(tiny_model_dir: Path, v1, tmp_path: Path):
    model, opt, path = v1
    root = tmp_path / "adapters"
    shutil.copytree(path, root / "v1")
    publish(root, 2, model, opt, {"parent": 1})
    w = root / "v2" / "adapter_model.safetensors"
    w.write_bytes(w.read_bytes()[:100])
    restored, restored_opt = fresh(tiny_model_dir)
    assert resume(restored, restored_opt, root)["version"] == 1
    with pytest.raises(AdapterError):  # asked for explicitly: no silent fallback
        resume(restored, restored_opt, root, version=2)


def test_publish_refuses_nan_weights_and_existing_versions(tiny_model_dir: Path, v1, tmp_path: Path):
    model, opt, _ = v1
    root = tmp_path / "adapters"
    publish(root, 1, model, opt, {"parent": None})
    with pytest.raises(AdapterError, match="exists"):
        publish(root, 1, model, opt, {"parent": None})

    broken, broken_opt = fresh(tiny_model_dir)
    with torch.no_grad():
        next(p for p in broken.parameters() if p.requires_grad)[0, 0] = float("nan")
    with pytest.raises(AdapterError, match="non-finite"):
        publish(root, 2, broken, broken_opt, {"parent": 1})
    assert sorted(p.name for p in root.iterdir()) == ["v1"]


def test_resume_refuses_a_different_lora_signature(tiny_model_dir: Path, v1):
    _, _, path = v1
    other = TrainConfig(lora_rank=8, lora_alpha=16)
    model, opt = fresh(tiny_model_dir, other)
    with pytest.raises(AdapterError, match="signature"):
        resume(model, opt, path.parent)


def test_a_version_sent_as_bytes_is_committed_unchanged_on_the_other_side(tiny_model_dir: Path, v1, tmp_path: Path):
    # What the trainer actor returns through Ray's object store, and the daemon commits.
    _, _, path = v1
    files = read_files(path)
    assert sorted(files) == sorted(adapters.FILES)  # PEFT's README.md is not part of a version
    got = install(tmp_path / "elsewhere", 1, files)
    assert got == tmp_path / "elsewhere" / "v1" and validate(got)["version"] == 1
    assert {p.name: p.read_bytes() for p in got.iterdir()} == files
    for version in (path, got):  # private: the dir 0700, every file 0600
        assert version.stat().st_mode & 0o777 == 0o700, version
        assert {p.stat().st_mode & 0o777 for p in version.iterdir()} == {0o600}
    model, opt = fresh(tiny_model_dir)
    assert resume(model, opt, got.parent, 1)["version"] == 1


def test_install_refuses_damaged_or_foreign_files_and_commits_nothing(v1, tmp_path: Path):
    _, _, path = v1
    files = read_files(path)
    root = tmp_path / "adapters"
    damaged = {**files, adapters.WEIGHTS: files[adapters.WEIGHTS][:-10]}
    with pytest.raises(AdapterError, match="sha256"):
        install(root, 1, damaged)
    with pytest.raises(AdapterError, match="expected files"):
        install(root, 1, {**files, "../escape": b"x"})
    with pytest.raises(AdapterError, match="expected files"):
        install(root, 1, {k: v for k, v in files.items() if k != adapters.OPTIMIZER})
    with pytest.raises(AdapterError, match="version"):  # v1's files are not v2
        install(root, 2, files)
    assert list(root.iterdir()) == [] and not (tmp_path / "escape").exists()
    install(root, 1, files)
    with pytest.raises(AdapterError, match="exists"):
        install(root, 1, files)
