"""In-process transformers + PEFT engine: CPU by default, CUDA when available.

One worker thread owns the model. It takes commands (start a generation, score, load/unload an
adapter) from a queue and steps every running generation one token at a time, round-robin, so
concurrent requests interleave and the asyncio loop never waits on torch. Tokens reach the loop
through `call_soon_threadsafe`. Because only the worker touches the model, adapter changes need
no locks: they happen between steps.

Mixed adapters in flight are served with PEFT's per-call `adapter_names`, so a generation that
started on version N finishes on N even after N+1 is activated. Versions live in reusable PEFT
adapter slots: a new version is read off the worker thread and copied into the slot of a retired
one, so a hot-swap stalls the streams for a tensor copy, not for building LoRA layers.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import queue
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncGenerator, Callable, Sequence

import torch

from clawback.engine import EngineError, Sampling, Token, read_model_info

from .grammar import GrammarMask, GrammarTokenizer

log = logging.getLogger(__name__)

BASE = "__base__"  # PEFT's name for "no adapter" in adapter_names
BACKGROUND_EVERY = 8


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


@dataclass(eq=False)
class _Generation:
    prompt_ids: list[int]
    sampling: Sampling
    adapter: str | None
    emit: Callable[[Any], object]  # thread-safe put into the consumer's asyncio queue
    cancelled: threading.Event = field(default_factory=threading.Event)
    cache: Any = None
    next_input: list[int] = field(default_factory=list)
    n_generated: int = 0
    rng: torch.Generator | None = None
    background: bool = False  # judge and other internal work: yields to serving
    mask: GrammarMask | None = None  # Sampling.constraint, compiled for this stream


_END = object()


class EmbeddedEngine:
    def __init__(
        self,
        model_dir: str | Path,
        device: str = "auto",
        dtype: str = "auto",
        name: str | None = None,
        torch_threads: int = 0,
    ) -> None:
        from transformers import AutoModelForCausalLM

        if torch_threads:
            torch.set_num_threads(torch_threads)
        self.device = pick_device(device)
        self.dtype = pick_dtype(dtype, self.device)
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=self.dtype)
        self.model = model.to(self.device).eval()  # pyright: ignore[reportArgumentType]  # transformers 5 mistypes .to
        # transformers renamed `past_key_values` to `cache` in 5.2x; accept both releases.
        self._cache_arg = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
        self.info = read_model_info(model_dir, name)
        self._grammar_tokenizer = GrammarTokenizer(str(model_dir), int(model.config.vocab_size))
        self._peft = False
        self._adapters: dict[str, str] = {}  # version -> path
        self._active: str | None = None
        self._inflight: dict[str, int] = {}  # version -> running generations
        self._retiring: set[str] = set()  # unload requested while still in use
        self._slots: dict[str, str] = {}  # version -> PEFT adapter name holding its weights
        self._slot_shape: dict[str, tuple] = {}  # every slot ever built -> its LoRA shape
        self._free_slots: list[str] = []  # slots of unloaded versions, refilled by the next load
        self._lock = threading.Lock()  # guards the three dicts above across loop and worker
        self._commands: queue.Queue = queue.Queue()
        self._running: list[_Generation] = []
        self._stopped = False
        self._thread = threading.Thread(target=self._work, name="clawback-engine", daemon=True)
        self._thread.start()

    # ---- public interface (called on the event loop) ----

    async def generate(
        self, prompt_ids: Sequence[int], sampling: Sampling, adapter: str | None = None, *, background: bool = False
    ) -> AsyncGenerator[Token, None]:
        if not prompt_ids:
            raise EngineError("empty prompt")
        mask = None
        if sampling.constraint is not None:
            mask = await asyncio.to_thread(
                lambda: GrammarMask(self._grammar_tokenizer.get(), sampling.constraint))  # type: ignore[arg-type]
        self._acquire(adapter)
        loop = asyncio.get_running_loop()
        out: asyncio.Queue = asyncio.Queue()
        gen = _Generation(
            prompt_ids=list(prompt_ids),
            sampling=sampling,
            adapter=adapter,
            emit=lambda item: loop.call_soon_threadsafe(out.put_nowait, item),
            background=background,
            mask=mask,
        )
        self._commands.put(("generate", gen))
        try:
            while True:
                item = await out.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise EngineError(str(item)) from item
                yield item
        finally:
            gen.cancelled.set()  # the worker drops it at its next step (and releases the adapter)

    async def score(
        self, prompt_ids: Sequence[int], response_ids: Sequence[int], adapter: str | None = None
    ) -> list[float]:
        if not prompt_ids:
            raise EngineError("empty prompt")
        if not response_ids:
            return []
        return await self._call("score", list(prompt_ids), list(response_ids), adapter)

    async def score_candidates(
        self, prompt_ids: Sequence[int], response_ids: Sequence[int], candidates: Sequence[Sequence[int]],
        adapter: str | None = None,
    ) -> list[list[float]]:
        if not prompt_ids:
            raise EngineError("empty prompt")
        if len(candidates) != len(response_ids):
            raise EngineError("one candidate list per response position is needed")
        if not response_ids:
            return []
        return await self._call("score", list(prompt_ids), list(response_ids), adapter,
                                [list(c) for c in candidates])

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

    async def start(self) -> None:
        """Nothing to launch: the model loaded with the engine."""

    def loaded_versions(self) -> list[str]:
        with self._lock:
            return [v for v in self._adapters if v not in self._retiring]

    def running(self) -> int:
        return len(self._running)

    async def close(self) -> None:
        if not self._stopped:
            self._stopped = True
            self._commands.put(("stop",))
            await asyncio.to_thread(self._thread.join, 30)

    # ---- helpers on the loop side ----

    def _acquire(self, adapter: str | None) -> None:
        if adapter is None:
            return
        with self._lock:
            if adapter not in self._adapters or adapter in self._retiring:
                raise EngineError(f"adapter {adapter!r} is not loaded")
            self._inflight[adapter] = self._inflight.get(adapter, 0) + 1

    async def _call(self, op: str, *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def reply(result: Any, error: BaseException | None) -> None:
            def settle() -> None:
                if fut.cancelled():
                    return
                if error is not None:
                    fut.set_exception(EngineError(str(error)))
                else:
                    fut.set_result(result)

            loop.call_soon_threadsafe(settle)

        self._commands.put((op, reply, *args))
        return await fut

    # ---- worker thread ----

    def _work(self) -> None:
        rounds = 0
        with torch.inference_mode():
            while True:
                rounds += 1
                try:
                    block = not self._running
                    while True:
                        cmd = self._commands.get(block=block)
                        block = False
                        if cmd[0] == "stop":
                            for gen in self._running:
                                gen.emit(EngineError("engine stopped"))
                            return
                        self._handle(cmd)
                except queue.Empty:
                    pass
                for gen in self._schedule(rounds):
                    self._step(gen)

    def _schedule(self, rounds: int) -> list[_Generation]:
        """Serving first: background generations step only when no request is being served, plus
        one round in BACKGROUND_EVERY so that they cannot starve."""
        foreground = [g for g in self._running if not g.background]
        if not foreground or rounds % BACKGROUND_EVERY == 0:
            return list(self._running)
        return foreground

    def _handle(self, cmd: tuple) -> None:
        op = cmd[0]
        if op == "generate":
            gen = cmd[1]
            self._running.append(gen)
            return
        reply = cmd[1]
        try:
            if op == "score":
                result = self._score(*cmd[2:])
            elif op == "load":
                result = self._load(*cmd[2:])
            elif op == "unload":
                result = self._unload(cmd[2])
            else:
                raise EngineError(f"unknown command {op}")
        except Exception as e:  # reported to the caller, never kills the worker
            reply(None, e)
        else:
            reply(result, None)

    def _forward(self, input_ids: list[int], adapter: str | None, cache: Any) -> Any:
        ids = torch.tensor([input_ids], dtype=torch.long, device=self.device)
        kwargs: dict[str, Any] = {"use_cache": True, self._cache_arg: cache}
        if self._peft:
            kwargs["adapter_names"] = [self._slots[adapter] if adapter else BASE]
        return self.model(input_ids=ids, **kwargs)

    def _step(self, gen: _Generation) -> None:
        if gen.cancelled.is_set():
            self._finish(gen, None)
            return
        try:
            if gen.cache is None:  # prefill
                from transformers import DynamicCache

                gen.cache = DynamicCache()
                gen.next_input = gen.prompt_ids
                if gen.sampling.seed is not None:
                    gen.rng = torch.Generator(device=self.device).manual_seed(gen.sampling.seed)
            out = self._forward(gen.next_input, gen.adapter, gen.cache)
            gen.cache = getattr(out, self._cache_arg)
            token = self._pick(gen, out.logits[0, -1].float())
            gen.n_generated += 1
            gen.next_input = [token.id]
            gen.emit(token)
            done = (
                token.id in gen.sampling.stop_token_ids
                or gen.n_generated >= gen.sampling.max_tokens
                or len(gen.prompt_ids) + gen.n_generated >= self.info.context_length
            )
            if done:
                self._finish(gen, _END)
        except Exception as e:
            log.exception("generation failed")
            self._finish(gen, e)

    def _finish(self, gen: _Generation, item: Any) -> None:
        self._running.remove(gen)
        gen.cache = None
        if item is not None:
            gen.emit(item)
        if gen.adapter is not None:
            with self._lock:
                self._inflight[gen.adapter] -= 1
                ready = gen.adapter in self._retiring and self._inflight[gen.adapter] == 0
            if ready:
                self._delete_adapter(gen.adapter)

    @classmethod
    def _pick(cls, gen: _Generation, logits: torch.Tensor) -> Token:
        """Sample one stream's next token from its logits row: through its grammar mask if it has
        one; logprobs (and the top-k) are read from the unmasked row."""
        token_id, sampled = cls._sample(gen.mask.apply(logits) if gen.mask else logits, gen.sampling, gen.rng)
        if gen.mask:
            gen.mask.advance(token_id)
        logp = torch.log_softmax(logits, dim=-1)
        k = gen.sampling.top_logprobs
        if not k:
            return Token(token_id, float(logp[token_id]), sampling_logprob=sampled)
        top = torch.topk(logp, k)
        return Token(token_id, float(logp[token_id]), tuple(top.indices.tolist()), tuple(top.values.tolist()), sampled)

    @staticmethod
    def _sample(logits: torch.Tensor, sampling: Sampling, rng: torch.Generator | None) -> tuple[int, float | None]:
        """The drawn token and its logprob under the distribution it was drawn from (None: greedy)."""
        if sampling.temperature <= 0:
            return int(torch.argmax(logits)), None
        probs = torch.softmax(logits / sampling.temperature, dim=-1)
        if sampling.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < sampling.top_p  # always keeps the top
            probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
            probs = probs / probs.sum()  # what multinomial draws from
        token_id = int(torch.multinomial(probs, 1, generator=rng))
        return token_id, float(torch.log(probs[token_id]))

    def _score(self, prompt_ids: list[int], response_ids: list[int], adapter: str | None,
               candidates: list[list[int]] | None = None) -> list[float] | list[list[float]]:
        """Logprobs of the response tokens, or of `candidates[t]` at each position t when given."""
        if len(prompt_ids) + len(response_ids) > self.info.context_length:
            raise EngineError("prompt + response exceed the context length")
        if adapter is not None and adapter not in self._adapters:
            raise EngineError(f"adapter {adapter!r} is not loaded")
        out = self._forward(prompt_ids + response_ids, adapter, None)
        start = len(prompt_ids) - 1
        logits = out.logits[0, start : start + len(response_ids)].float()
        logp = torch.log_softmax(logits, dim=-1)
        if candidates is not None:
            width = max(len(c) for c in candidates)
            if any(len(c) != width for c in candidates):
                raise EngineError("every position needs the same number of candidates")
            return logp.gather(1, torch.tensor(candidates, device=logp.device)).tolist()
        target = torch.tensor(response_ids, device=logp.device).unsqueeze(1)
        return logp.gather(1, target).squeeze(1).tolist()

    def _load(self, version: str, path: str, weights: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
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
        slot = next((s for s in self._free_slots if self._slot_shape[s] == _shape(config)), None)
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
            self._slot_shape[slot] = _shape(config)
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


def _shape(config: dict[str, Any]) -> tuple:
    """What must match for a slot to take another version's weights by copying."""
    keys = ("r", "lora_alpha", "target_modules", "use_rslora", "use_dora", "bias", "rank_pattern", "alpha_pattern")
    return tuple(json.dumps(config.get(k), sort_keys=True) for k in keys)


def read_adapter(path: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Read a PEFT adapter dir (weights and config) without touching the model: done off the
    engine thread, so only the copy into the slot happens between decode steps."""
    from safetensors.torch import load_file

    p = Path(path)
    config = json.loads((p / "adapter_config.json").read_text())
    weights_file = p / "adapter_model.safetensors"
    if not weights_file.is_file():
        raise EngineError(f"{p} has no adapter_model.safetensors")
    return load_file(str(weights_file)), config
