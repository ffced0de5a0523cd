"""The embedded engine's adapter versions, each in a reusable PEFT adapter slot: a new version is
read off the worker thread and copied into the slot of a retired one, so a hot-swap stalls the
streams for a tensor copy, not for building LoRA layers."""

from __future__ import annotations

import asyncio
import json
import threading
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch

from clawback.engine import EngineError
from clawback.records import JsonObject

BASE = "__base__"  # PEFT's name for "no adapter" in adapter_names


class AdapterSlots(ABC):
    """Which versions are loaded, active and in use, for EmbeddedEngine: the loop side checks and
    counts them under a lock; the worker thread loads and deletes them (`_load`, `_unload`)."""

    model: Any  # the transformers model; a PeftModel once the first version is loaded

    def __init__(self) -> None:
        self._peft = False
        self._adapters: dict[str, str] = {}  # version -> path
        self._active: str | None = None
        self._inflight: dict[str, int] = {}  # version -> running generations
        self._retiring: set[str] = set()  # unload requested while still in use
        self._slots: dict[str, str] = {}  # version -> PEFT adapter name holding its weights
        self._slot_shape: dict[str, tuple] = {}  # every slot ever built -> its LoRA shape
        self._free_slots: list[str] = []  # slots of unloaded versions, refilled by the next load
        self._lock = threading.Lock()  # guards the three dicts above across loop and worker

    @abstractmethod
    async def _call(self, op: str, *args: object) -> object:
        """Runs `op` on the worker thread (EmbeddedEngine)."""

    async def load_adapter(self, version: str, path: str) -> None:
        if version == BASE:
            raise EngineError(f"{BASE!r} is reserved")
        try:
            weights, config = await asyncio.to_thread(read_adapter, str(path))
        except (OSError, ValueError) as e:
            raise EngineError(f"cannot read adapter {version!r} at {path}: {e}") from e
        await self._call("load", version, str(path), weights, config)

    async def activate(self, version: str | None) -> None:
        with self._lock:
            if version is not None and version not in self._adapters:
                raise EngineError(f"adapter {version!r} is not loaded")
            self._active = version

    async def unload(self, version: str) -> None:
        with self._lock:
            if version == self._active:
                raise EngineError(f"adapter {version!r} is active; activate another first")
            if version not in self._adapters:
                raise EngineError(f"adapter {version!r} is not loaded")
        await self._call("unload", version)


    def active_version(self) -> str | None:
        return self._active


    def loaded_versions(self) -> list[str]:
        with self._lock:
            return [v for v in self._adapters if v not in self._retiring]


    def _acquire(self, adapter: str | None) -> None:
        if adapter is None:
            return
        with self._lock:
            if adapter not in self._adapters or adapter in self._retiring:
                raise EngineError(f"adapter {adapter!r} is not loaded")
            self._inflight[adapter] = self._inflight.get(adapter, 0) + 1


    def _release(self, adapter: str | None) -> None:
        """One user of the adapter less; a retiring adapter goes when its last user does."""
        if adapter is not None:
            with self._lock:
                self._inflight[adapter] -= 1
                ready = adapter in self._retiring and self._inflight[adapter] == 0
            if ready:
                self._delete_adapter(adapter)


    def _load(self, version: str, path: str, weights: dict[str, torch.Tensor], config: JsonObject) -> None:
        """Load a version into a PEFT adapter slot. A free slot of the same shape is refilled with
        plain tensor copies (milliseconds); only a new shape builds new LoRA layers, which takes
        the PEFT bookkeeping of inserting every layer and stalls all streams meanwhile."""
        from peft import PeftModel, set_peft_model_state_dict

        with self._lock:
            if version in self._retiring:  # unloading, but its weights are still in place: keep it
                self._retiring.discard(version)
                return
            if version in self._adapters:
                raise EngineError(f"adapter {version!r} is already loaded")
        slot = next((s for s in self._free_slots if self._slot_shape[s] == lora_shape(config)), None)
        if slot is not None:
            result = set_peft_model_state_dict(self.model, weights, adapter_name=slot)
            if getattr(result, "unexpected_keys", None):
                raise EngineError(f"adapter {version!r} does not fit slot {slot}: {result.unexpected_keys[:3]}")
            self._free_slots.remove(slot)
        else:
            slot = f"slot{len(self._slot_shape)}"
            if not self._peft:
                self.model = PeftModel.from_pretrained(self.model, path, adapter_name=slot).eval()
                self._peft = True
            else:
                self.model.load_adapter(path, adapter_name=slot)
            self._slot_shape[slot] = lora_shape(config)
        with self._lock:
            self._adapters[version] = path
            self._slots[version] = slot
            self._inflight.setdefault(version, 0)

    def _unload(self, version: str) -> None:
        with self._lock:
            busy = self._inflight.get(version, 0) > 0
            if busy:
                self._retiring.add(version)
        if not busy:
            self._delete_adapter(version)

    def _delete_adapter(self, version: str) -> None:
        # The slot is kept for the next version of the same shape (see _load).
        with self._lock:
            self._adapters.pop(version, None)
            self._inflight.pop(version, None)
            self._retiring.discard(version)
            self._free_slots.append(self._slots.pop(version))


def lora_shape(config: JsonObject) -> tuple:
    """What must match for a slot to take another version's weights by copying."""
    keys = ("r", "lora_alpha", "target_modules", "use_rslora", "use_dora", "bias", "rank_pattern", "alpha_pattern")
    return tuple(json.dumps(config.get(k), sort_keys=True) for k in keys)


def read_adapter(path: str) -> tuple[dict[str, torch.Tensor], JsonObject]:
    """Read a PEFT adapter dir (weights and config) without touching the model: done off the
    engine thread, so only the copy into the slot happens between decode steps."""
    from safetensors.torch import load_file

    p = Path(path)
    config = json.loads((p / "adapter_config.json").read_text())
    weights_file = p / "adapter_model.safetensors"
    if not weights_file.is_file():
        raise EngineError(f"{p} has no adapter_model.safetensors")
    return load_file(str(weights_file)), config
