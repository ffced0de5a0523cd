"""The trainer process: the trainable copy of the policy (base + LoRA) and its optimizer.

`TrainerWorker` is a plain class; the daemon runs it as a Ray actor (`ray.remote(TrainerWorker)`),
so training never shares a process or an event loop with serving, and the layout can place it on
another GPU or node. It shares no filesystem with the daemon: each version is published into the
actor's own dir (which also holds what `resume` needs) and returned as bytes, which travel back
through Ray's object store; the daemon commits them into its adapters dir. Versions the actor does
not hold (after a rollback, or in a fresh actor) arrive as bytes the same way.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from clawback.adapter_format import install, list_versions, publish, read_files, resume, version_dir
from clawback.records import TrainResult

from .config import TrainConfig
from .priority import ServingPriority, lower_priority
from .step import TrainSample, make_lora_model, make_optimizer, train_step

log = logging.getLogger(__name__)


_DIR_PREFIX = "clawback-trainer-"  # + pid of the actor process that owns it


def _remove_dirs_of_dead_trainers() -> None:
    # A killed actor (OOM, kill -9, a node restart) cannot clean up after itself.
    for path in Path(tempfile.gettempdir()).glob(f"{_DIR_PREFIX}*-*"):
        pid = path.name.removeprefix(_DIR_PREFIX).split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def release_freed_memory() -> None:
    """Give the step's freed activations back to the OS. glibc keeps freed heap memory (and, after
    the first large free, serves allocations up to 32 MB from the heap instead of fresh mmaps), so
    without a trim the actor's RSS stays at its largest step and grows with fragmentation."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def return_large_frees_at_once() -> None:
    """Serve every allocation of 1 MiB or more from its own mmap, returned to the OS when freed.
    glibc otherwise raises its mmap threshold (up to 32 MB) after the first large free and serves
    activations from the heap, where the tensors a step keeps pin the freed ones between them: a
    SmolLM2 micro-batch of 960 tokens peaked at 1.87 GB that way and at 1.24 GB with this."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD


def ray_node_id() -> str | None:
    """The Ray node this process runs on (None outside Ray): where a version was trained."""
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None


def attention_for(device: torch.device) -> str:
    """flash-attn on CUDA when `install.sh --gpu` installed it, else PyTorch's SDPA (which has its
    own flash kernel for bf16 on recent GPUs but takes a slower path with padding masks)."""
    if device.type == "cuda":
        import importlib.util

        if importlib.util.find_spec("flash_attn") is not None:
            return "flash_attention_2"
    return "sdpa"


HOLD_ENV = "CLAWBACK_TRAIN_HOLD_FILE"


def _hold_while_asked() -> None:
    """A pause point for fault-injection tests: while the file named by $CLAWBACK_TRAIN_HOLD_FILE
    exists, a step waits here, begun and not yet done, with this process's pid in `<file>.held`
    (so a test can kill the actor at a point it knows). Unset, it costs one lookup."""
    hold = os.environ.get(HOLD_ENV)
    if not hold or not Path(hold).exists():
        return
    Path(hold + ".held").write_text(str(os.getpid()))
    while Path(hold).exists():
        time.sleep(0.1)


class TrainerWorker:
    def __init__(self, model_dir: str, cfg: TrainConfig, adapters_root: str | None = None, device: str = "auto",
                 torch_threads: int = 0, serving: tuple[str, str | None] | None = None) -> None:
        """`serving`: the daemon's serving gauge and its Ray node; on that node the worker runs at
        lower CPU priority and yields to requests between micro-batches (trainer/priority.py)."""
        from transformers import AutoModelForCausalLM

        if not Path(model_dir).is_dir():  # the base model is not shipped: it must be on this node
            raise FileNotFoundError(f"base model not found at {model_dir} on the trainer's node {ray_node_id()}")
        if torch_threads:
            torch.set_num_threads(torch_threads)
        return_large_frees_at_once()
        self.priority = ServingPriority(None)
        if serving is not None and serving[1] == ray_node_id():
            self.priority = ServingPriority(serving[0])
            lower_priority(self.priority.daemon_pid())
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        base = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=dtype, attn_implementation=attention_for(self.device),
        ).to(self.device)  # pyright: ignore[reportArgumentType]  # transformers 5 mistypes .to
        if adapters_root is None:  # private to this actor; the daemon holds every version that matters
            _remove_dirs_of_dead_trainers()
            adapters_root = tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{os.getpid()}-")
            weakref.finalize(self, shutil.rmtree, adapters_root, True)
        self.cfg, self.root = cfg, Path(adapters_root)
        self.model = make_lora_model(base, cfg)
        # Yield points inside a micro-batch too: before each decoder layer, in the forward and (with
        # checkpointing) in the backward's recomputation, so a request waits for one layer at most.
        decoder: Any = base.get_decoder()  # Any: its `layers` are not in transformers' types
        for layer in decoder.layers:
            layer.register_forward_pre_hook(lambda *_: self.priority.wait())
        self.optimizer = make_optimizer(self.model, cfg)
        self.version: int | None = None

    def resume(self, version: int | None, files: dict[str, bytes] | None = None) -> int | None:
        """Continue from a committed version (weights and optimizer state); None = fresh LoRA.

        `files` (from `adapters.read_files`) are installed first when this actor's dir lacks the
        version, so the daemon can resume any version it holds on whichever node this runs.
        """
        if version is None:
            if self.version is not None:  # start over from the base model
                for name, p in self.model.named_parameters():
                    if "lora_B" in name:
                        torch.nn.init.zeros_(p)  # B = 0: the adapter is the identity again
                self.optimizer = make_optimizer(self.model, self.cfg)
            self.version = None
            return None
        if not version_dir(self.root, version).is_dir() and files is not None:
            install(self.root, version, files)
        resume(self.model, self.optimizer, self.root, version)
        self.version = version
        self._keep_only(version)
        return version

    def train(self, samples: Sequence[TrainSample], version: int, meta: dict[str, object]) -> TrainResult:
        """One optimizer step on `samples`, published as `v{version}` and returned as its files."""
        t0 = time.time()
        _hold_while_asked()
        self.priority.start_step()
        waited = self.priority.waited_s
        metrics = train_step(self.model, self.optimizer, samples, self.cfg, before_micro_batch=self.priority.wait)
        metrics["yielded_s"] = self.priority.waited_s - waited
        parent, node = self.version, ray_node_id()
        target = version_dir(self.root, version)  # the daemon numbers versions: a leftover here is not it
        shutil.rmtree(target, ignore_errors=True)
        try:
            path = publish(self.root, version, self.model, self.optimizer,
                           {**meta, "parent": parent, "metrics": metrics, "train_s": time.time() - t0,
                            "trainer_node": node})
            files = read_files(path)
        except BaseException:
            shutil.rmtree(target, ignore_errors=True)
            self.resume(parent)  # the weights moved but no version holds them: go back
            raise
        self.version = version
        self._keep_only(version)
        release_freed_memory()
        return TrainResult(version=version, parent=parent, node=node, metrics=metrics, files=files)

    def ping(self) -> int | None:
        return self.version

    def close(self) -> None:
        """The daemon is shutting down: this dir holds nothing the daemon lacks."""
        shutil.rmtree(self.root, ignore_errors=True)

    def _keep_only(self, version: int) -> None:
        # Only the current version is needed here (to go back after a failed step); the daemon
        # sends any other one when it is wanted.
        for v in list_versions(self.root):
            if v != version:
                shutil.rmtree(version_dir(self.root, v), ignore_errors=True)
