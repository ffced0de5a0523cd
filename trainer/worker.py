"""The trainer process: the trainable copy of the policy (base + LoRA) and its optimizer.

`TrainerWorker` is a plain class; the daemon runs it as a Ray actor (`ray.remote(TrainerWorker)`),
so training never shares a process or an event loop with serving, and `--ray-address` can place
it on another GPU or node. It publishes each version into the adapters dir itself; with a remote
Ray cluster that dir must be on storage the engine host also sees.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from .adapters import publish, resume
from .config import TrainConfig
from .step import Sample, make_lora_model, make_optimizer, train_step

log = logging.getLogger(__name__)


class TrainerWorker:
    def __init__(self, model_dir: str, cfg: TrainConfig, adapters_root: str, device: str = "auto",
                 torch_threads: int = 0) -> None:
        from transformers import AutoModelForCausalLM

        if torch_threads:
            torch.set_num_threads(torch_threads)
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(self.device)
        self.cfg, self.root = cfg, Path(adapters_root)
        self.model = make_lora_model(base, cfg)
        self.optimizer = make_optimizer(self.model, cfg)
        self.version: int | None = None

    def resume(self, version: int | None) -> int | None:
        """Continue from a committed version (weights and optimizer state); None = fresh LoRA."""
        if version is None:
            if self.version is not None:  # start over from the base model
                for name, p in self.model.named_parameters():
                    if "lora_B" in name:
                        torch.nn.init.zeros_(p)  # B = 0: the adapter is the identity again
                self.optimizer = make_optimizer(self.model, self.cfg)
            self.version = None
            return None
        resume(self.model, self.optimizer, self.root, version)
        self.version = version
        return version

    def train(self, samples: list[dict[str, Any]], version: int, meta: dict[str, Any]) -> dict[str, Any]:
        """One optimizer step on `samples`, published atomically as `v{version}`."""
        t0 = time.time()
        batch = [Sample(prompt_ids=s["prompt_ids"], response_ids=s["response_ids"],
                        behaviour_logprobs=s["behaviour_logprobs"], reward=s["reward"],
                        teacher_logprobs=s.get("teacher_logprobs")) for s in samples]
        metrics = train_step(self.model, self.optimizer, batch, self.cfg)
        parent = self.version
        try:
            path = publish(self.root, version, self.model, self.optimizer,
                           {**meta, "parent": parent, "metrics": metrics, "train_s": time.time() - t0})
        except BaseException:
            self.resume(parent)  # the weights moved but no version holds them: go back
            raise
        self.version = version
        return {"version": version, "parent": parent, "path": str(path), "metrics": metrics}

    def ping(self) -> int | None:
        return self.version
