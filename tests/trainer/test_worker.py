"""The trainer actor's class, used directly (no Ray): it shares no filesystem with the daemon, so
versions leave it as bytes and come back to it as bytes."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load

from clawback.adapter_format import WEIGHTS, install, list_versions, validate
from clawback.trainer.config import TrainConfig
from clawback.trainer.step import Sample
from clawback.trainer.worker import TrainerWorker

CFG = TrainConfig(method="binary", lora_rank=4, lora_alpha=8, lr=1e-2)



def batch(seed: int) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    return [Sample(prompt_ids=torch.randint(3, 49152, (5,), generator=g).tolist(),
                   response_ids=torch.randint(3, 49152, (4,), generator=g).tolist(),
                   behaviour_logprobs=(-10 + torch.randn(4, generator=g)).tolist(),
                   reward=1.0 if i % 2 else -1.0) for i in range(2)]


def test_train_returns_the_version_as_files_and_keeps_only_the_current_one(tiny_model_dir: Path):
    w = TrainerWorker(str(tiny_model_dir), CFG)
    assert w.root.is_dir() and list_versions(w.root) == []  # its own private dir
    first = w.train(batch(0), 1, {"samples": 2})
    second = w.train(batch(1), 2, {"samples": 2})
    assert (first.parent, second.parent, second.node) == (None, 1, None)  # no Ray: no node
    assert list_versions(w.root) == [2]  # the daemon holds v1; the actor needs only where it stands
    assert second.files[WEIGHTS] == (w.root / "v2" / WEIGHTS).read_bytes()
    assert load(second.files[WEIGHTS]) and second.metrics["samples"] == 2


def test_a_fresh_worker_resumes_from_files_it_never_had(tiny_model_dir: Path, tmp_path: Path):
    # Like a rollback to a version the actor pruned, or a new actor on another node.
    a = TrainerWorker(str(tiny_model_dir), CFG)
    v1 = a.train(batch(0), 1, {})
    a.train(batch(1), 2, {})
    a.resume(1, v1.files)  # back to v1, which a no longer held
    b = TrainerWorker(str(tiny_model_dir), CFG)
    assert b.resume(1, v1.files) == 1 and validate(b.root / "v1")["version"] == 1
    next_a, next_b = a.train(batch(2), 3, {}), b.train(batch(2), 3, {})
    wa, wb = load(next_a.files[WEIGHTS]), load(next_b.files[WEIGHTS])
    for k in wa:  # same weights and optimizer state in, same step out
        torch.testing.assert_close(wa[k], wb[k], atol=1e-6, rtol=0)
    daemon_side = install(tmp_path / "adapters", 3, next_b.files)
    assert validate(daemon_side)["parent"] == 1


def test_resume_without_the_version_or_its_files_fails_and_keeps_the_weights(tiny_model_dir: Path):
    w = TrainerWorker(str(tiny_model_dir), CFG)
    w.train(batch(0), 1, {})
    with pytest.raises(Exception, match="v5"):
        w.resume(5)
    assert w.ping() == 1 and list_versions(w.root) == [1]


def test_a_missing_base_model_is_a_clear_error(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="base model not found"):
        TrainerWorker(str(tmp_path / "nowhere"), CFG)


def test_its_private_dir_goes_on_close_and_dirs_of_dead_actors_on_the_next_start(tiny_model_dir: Path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    leftover = Path(tempfile.mkdtemp(prefix=f"clawback-trainer-{dead.pid}-"))  # as a killed actor leaves it
    (leftover / "v1").mkdir()
    w = TrainerWorker(str(tiny_model_dir), CFG)
    assert not leftover.exists() and str(os.getpid()) in w.root.name
    w.train(batch(0), 1, {})
    w.close()
    assert not w.root.exists()
