"""In-process transformers + PEFT engine: CPU by default, CUDA when available.

One worker thread owns the model. It takes commands (start a generation, score, load/unload an
adapter) from a queue and decodes every running generation in one batched forward per step: the
streams share one KV cache, left-padded so that each row's tokens end at the same column, with an
attention mask over the padding and each row's own positions. Prompts that arrive together are
prefilled in one left-padded forward and then join the batch; a finished stream leaves it. Each
row is sampled with its own settings, and its logprob is read from its own row of the unscaled
distribution, so `score()` reproduces it.

Serving first: background work (the judge, the gate's probes, every `score()`: replay, note
retirement, teacher logprobs) runs in slices of at most BACKGROUND_TOKENS tokens per forward: a
background prompt is prefilled alone, BACKGROUND_TOKENS columns at a time; background streams
decode in batches of at most BACKGROUND_TOKENS rows; a scoring pass runs its sequence in chunks
of that many tokens over a KV cache. Once no request has been served for BACKGROUND_IDLE_S, a
prefill or scoring chunk may take BACKGROUND_IDLE_TOKENS columns: nobody is waiting then, and a
wider forward costs less per token. A forward cannot be interrupted, so the rule that admits
requests first is about when a slice starts (`background_turn`): never while a command (a new
request) is waiting; while requests are served, one slice in BACKGROUND_EVERY rounds, so that
background work cannot starve; otherwise only once no request has been served for
BACKGROUND_HOLD_S. An agent's next call usually follows its last reply within that hold and
finds the engine free; a request that arrives later, during background work, waits for at most
one slice, which on CPU costs about half to three quarters of a short request's own prefill
(bench/README.md, "Serving first"). The asyncio loop never waits on torch; tokens reach it
through `call_soon_threadsafe`. Because only the worker touches the model, adapter changes need
no locks: they happen between steps.

Mixed adapters in flight are served with PEFT's per-row `adapter_names`, so a generation that
started on version N finishes on N even after N+1 is activated. Versions live in reusable PEFT
adapter slots: a new version is read off the worker thread and copied into the slot of a retired
one, so a hot-swap stalls the streams for a tensor copy, not for building LoRA layers.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers.cache_utils import Cache

from clawback.engine import EngineError, Sampling, Token, read_model_info

from .embedded_adapters import BASE, AdapterSlots
from .embedded_batch import END, Batch, Generation, KVLayer, pick_token
from .grammar import GrammarMask, GrammarTokenizer

log = logging.getLogger(__name__)

BACKGROUND_EVERY = 8
# Tokens one background forward may take: the chunk of a prefill or a scoring pass, the rows of
# a decode step. On CPU a forward's fixed cost (reading the weights) dominates small ones: on
# SmolLM2-135M, 1 thread, a forward of 1, 16, 32 and 48 tokens took 174, 285, 412 and 427 ms on a
# loaded machine, so a 16-token slice costs well under a short request's own prefill.
BACKGROUND_TOKENS = 16
# After the last request leaves, background work waits this long: an agent's next call follows
# its last reply within a fraction of a second (parse the reply, run a quick tool, send), and a
# call that arrives behind a slice waits for all of it (a forward cannot be interrupted).
BACKGROUND_HOLD_S = 0.5
# After this long without a request (a person reading or typing, not an agent between calls), a
# prefill or scoring chunk may take BACKGROUND_IDLE_TOKENS columns. Per token a forward of 64
# costs about a third of one of 16 (Qwen2.5-Coder-0.5B, 2 threads, after a 200-token prefix: 0.54 s
# against 0.36 s; an idle review 1.6x faster, bench/README.md "Background chunks when idle"), and
# a request that arrives during such a slice waits about 0.2 s longer than behind a narrow one.
BACKGROUND_IDLE_S = 5.0
BACKGROUND_IDLE_TOKENS = 64


def background_turn(serving: bool, request_waiting: bool, rounds: int, since_served_s: float) -> bool:
    """Whether the worker runs one slice of background work now (some is waiting). Never while a
    command (a new request) waits; while requests are served, in one round of BACKGROUND_EVERY,
    so that background work cannot starve; otherwise once no request has been served for
    BACKGROUND_HOLD_S, so that a client's next call, which usually follows its last reply within
    that time, does not arrive behind a slice."""
    if request_waiting:
        return False
    if serving:
        return rounds % BACKGROUND_EVERY == 0
    return since_served_s >= BACKGROUND_HOLD_S


def slice_tokens(since_served_s: float) -> int:
    """Columns of one background prefill or scoring chunk: BACKGROUND_TOKENS while requests may
    come, BACKGROUND_IDLE_TOKENS once none has been served for BACKGROUND_IDLE_S."""
    return BACKGROUND_IDLE_TOKENS if since_served_s >= BACKGROUND_IDLE_S else BACKGROUND_TOKENS


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


class EmbeddedEngine(AdapterSlots):
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
        AdapterSlots.__init__(self)
        self._commands: queue.Queue = queue.Queue()
        self._serving = Batch()
        self._background: list[Batch] = []  # background streams decoding, BACKGROUND_TOKENS rows at most each
        self._background_gens: set[Generation] = set()  # every background stream not finished yet
        # Background work, one slice per next(), each with what tells its callers the engine stopped.
        self._jobs: collections.deque[tuple[Iterator[None], Callable[[BaseException], None]]] = collections.deque()
        self._stopped = False
        self._served_at = float("-inf")  # monotonic time of the last serving step
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
        cancelled = threading.Event()

        def emit(item: Any) -> None:
            try:
                loop.call_soon_threadsafe(out.put_nowait, item)
            except RuntimeError:  # the consumer's event loop is closed: nobody reads this stream
                cancelled.set()  # dropped at the next step; the other rows go on

        gen = Generation(
            prompt_ids=list(prompt_ids),
            sampling=sampling,
            adapter=adapter,
            emit=emit,
            cancelled=cancelled,
            background=background,
            mask=mask,
        )
        self._commands.put(("generate", gen))
        try:
            while True:
                item = await out.get()
                if item is END:
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

    async def start(self) -> None:
        """Nothing to launch: the model loaded with the engine."""

    def running(self) -> int:
        return len(self._serving) + len(self._background_gens)

    async def close(self) -> None:
        if not self._stopped:
            self._stopped = True
            self._commands.put(("stop",))
            await asyncio.to_thread(self._thread.join, 30)

    # ---- helpers on the loop side ----

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
                    # Wait for a command: not while serving, forever when there is nothing to do,
                    # until the hold after the last request ends when background work waits.
                    hold = self._served_at + BACKGROUND_HOLD_S - time.monotonic()
                    block = not self._serving and (not self._jobs or hold > 0)
                    timeout = hold if self._jobs and hold > 0 else None
                    while True:
                        cmd = self._commands.get(block=block, timeout=timeout)
                        block = False
                        if cmd[0] == "stop":
                            stopped = EngineError("engine stopped")
                            for gen in self._serving.pending + self._serving.gens:
                                gen.emit(stopped)
                            for _, fail in self._jobs:
                                fail(stopped)
                            return
                        self._handle(cmd)
                except queue.Empty:
                    pass
                if self._serving:
                    self._step(self._serving)
                    self._served_at = time.monotonic()
                if self._jobs and background_turn(bool(self._serving), not self._commands.empty(), rounds,
                                                  time.monotonic() - self._served_at):
                    self._background_slice()

    def _background_slice(self) -> None:
        """One slice of the oldest background job; the job goes to the back of the line."""
        job = self._jobs.popleft()
        try:
            next(job[0])
        except StopIteration:
            return
        self._jobs.append(job)

    def _handle(self, cmd: tuple) -> None:
        op = cmd[0]
        if op == "generate":
            gen = cmd[1]
            if gen.background:
                self._background_gens.add(gen)
                self._jobs.append((self._background_prefill(gen), gen.emit))
            else:
                self._serving.pending.append(gen)
            return
        reply = cmd[1]
        if op == "score":
            self._jobs.append((self._score(reply, *cmd[2:]), lambda e: reply(None, e)))
            return
        try:
            if op == "load":
                result = self._load(*cmd[2:])
            elif op == "unload":
                result = self._unload(cmd[2])
            else:
                raise EngineError(f"unknown command {op}")
        except Exception as e:  # reported to the caller, never kills the worker
            reply(None, e)
        else:
            reply(result, None)

    def _forward(self, input_ids: torch.Tensor, adapters: Sequence[str | None], cache: Any, **kwargs: Any) -> Any:
        kwargs.update({"use_cache": cache is not None, self._cache_arg: cache})
        if self._peft:
            kwargs["adapter_names"] = [self._slots[a] if a else BASE for a in adapters]
        return self.model(input_ids=input_ids, **kwargs)

    def _step(self, batch: Batch) -> None:
        """One decode step for the batch's rows, then the prefill of the generations waiting to join."""
        cancelled = {g for g in batch.gens if g.cancelled.is_set()}
        if cancelled:
            batch.remove(cancelled)
            for gen in cancelled:
                self._finish(gen, None)
        if batch.gens:
            try:
                self._decode(batch)
            except Exception as e:
                log.exception("decode step failed")
                gens = set(batch.gens)
                batch.remove(gens)
                for gen in gens:
                    self._finish(gen, e)
        pending, batch.pending = batch.pending, []
        for gen in [g for g in pending if g.cancelled.is_set()]:
            pending.remove(gen)
            self._finish(gen, None)
        if pending:
            try:
                batch.merge(self._prefill(pending))
            except Exception as e:
                log.exception("prefill failed")
                for gen in pending:
                    self._finish(gen, e)

    def _decode(self, batch: Batch) -> None:
        gens = batch.gens
        ids = torch.tensor([[g.last_token] for g in gens], dtype=torch.long, device=self.device)
        assert batch.mask is not None  # only a batch with rows is decoded
        batch.mask = torch.nn.functional.pad(batch.mask, (0, 1), value=1)
        positions = torch.tensor([[len(g.prompt_ids) + g.n_generated - 1] for g in gens], device=self.device)
        out = self._forward(ids, [g.adapter for g in gens], batch.cache,
                            attention_mask=batch.mask, position_ids=positions)
        self._emit_rows(batch, out.logits[:, -1].float())

    def _prefill(self, gens: list[Generation]) -> Batch:
        """Run the waiting prompts in one left-padded forward and sample each one's first token;
        the generations that go on, as a batch to merge."""
        width = max(len(g.prompt_ids) for g in gens)
        ids = torch.zeros(len(gens), width, dtype=torch.long)
        mask = torch.zeros(len(gens), width, dtype=torch.long)
        for i, gen in enumerate(gens):
            ids[i, width - len(gen.prompt_ids) :] = torch.tensor(gen.prompt_ids)
            mask[i, width - len(gen.prompt_ids) :] = 1
            if gen.sampling.seed is not None:
                gen.rng = torch.Generator(device=self.device).manual_seed(gen.sampling.seed)
        ids, mask = ids.to(self.device), mask.to(self.device)
        padded = {"attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)} if len(gens) > 1 else {}
        batch = Batch()
        batch.gens, batch.cache, batch.mask = list(gens), Cache(layer_class_to_replicate=KVLayer), mask
        out = self._forward(ids, [g.adapter for g in gens], batch.cache, logits_to_keep=1, **padded)
        if padded:
            for kv in batch.cache.layers:
                kv.zero_padding(mask)
        self._emit_rows(batch, out.logits[:, -1].float())
        return batch

    def _emit_rows(self, batch: Batch, logits: torch.Tensor) -> None:
        """Sample each row's next token from its own logits and emit it; finished generations
        leave the batch."""
        logprobs = torch.log_softmax(logits, dim=-1)
        done = {gen for gen, row, logp in zip(batch.gens, logits, logprobs) if self._advance(gen, row, logp)}
        if done:
            batch.remove(done)
            for gen in done:
                self._finish(gen, END)

    def _advance(self, gen: Generation, logits: torch.Tensor, logprobs: torch.Tensor) -> bool:
        """Sample the generation's next token from its row and emit it; True when it is done."""
        token = pick_token(gen, logits, logprobs)
        gen.n_generated += 1
        gen.last_token = token.id
        gen.emit(token)
        return (
            token.id in gen.sampling.stop_token_ids
            or gen.n_generated >= gen.sampling.max_tokens
            or len(gen.prompt_ids) + gen.n_generated >= self.info.context_length
        )

    def _finish(self, gen: Generation, item: Any) -> None:
        if item is not None:
            gen.emit(item)
        self._background_gens.discard(gen)
        self._release(gen.adapter)

    # ---- background jobs: generators, one slice per next() ----

    def _background_prefill(self, gen: Generation) -> Iterator[None]:
        """Prefill one background prompt alone, `slice_tokens` columns per slice; then sample
        its first token and put it in a background batch with room."""
        ids, cache, out = gen.prompt_ids, Cache(layer_class_to_replicate=KVLayer), None
        try:
            if gen.sampling.seed is not None:
                gen.rng = torch.Generator(device=self.device).manual_seed(gen.sampling.seed)
            for start, end in self._chunks(0, len(ids)):
                if start:
                    yield
                if gen.cancelled.is_set():
                    self._finish(gen, None)
                    return
                chunk = torch.tensor([ids[start:end]], dtype=torch.long, device=self.device)
                out = self._forward(chunk, [gen.adapter], cache, logits_to_keep=1)
        except Exception as e:
            log.exception("background prefill failed")
            self._finish(gen, e)
            return
        assert out is not None  # a prompt has at least one token, so at least one slice ran
        batch = Batch()
        batch.gens, batch.cache = [gen], cache
        batch.mask = torch.ones(1, len(ids), dtype=torch.long, device=self.device)
        self._emit_rows(batch, out.logits[:, -1].float())
        if not batch.gens:
            return
        room = next((b for b in self._background if len(b.gens) < BACKGROUND_TOKENS), None)
        if room is not None:
            room.merge(batch)
        else:
            self._background.append(batch)
            self._jobs.append((self._background_decode(batch), lambda e: self._fail_all(batch, e)))

    def _chunks(self, start: int, stop: int) -> Iterator[tuple[int, int]]:
        """[start, end) column ranges covering start..stop, each as wide as `slice_tokens` allows
        when it is taken: a job that began while requests came widens once they stop."""
        while start < stop:
            end = min(start + slice_tokens(time.monotonic() - self._served_at), stop)
            yield start, end
            start = end

    @staticmethod
    def _fail_all(batch: Batch, error: BaseException) -> None:
        for g in batch.gens:
            g.emit(error)

    def _background_decode(self, batch: Batch) -> Iterator[None]:
        """One decode step of a background batch per slice, until its last stream ends."""
        while True:
            self._step(batch)
            if not batch.gens:
                self._background.remove(batch)
                return
            yield

    def _score(self, reply: Callable[[Any, BaseException | None], None], prompt_ids: list[int],
               response_ids: list[int], adapter: str | None,
               candidates: list[list[int]] | None = None) -> Iterator[None]:
        """Reply with the logprobs of the response tokens, or of `candidates[t]` at each position t
        when given. The sequence runs `slice_tokens` tokens per slice over a KV cache; only the
        positions that predict a response token get logits."""
        try:
            if len(prompt_ids) + len(response_ids) > self.info.context_length:
                raise EngineError("prompt + response exceed the context length")
            if candidates is not None and any(len(c) != len(candidates[0]) for c in candidates):
                raise EngineError("every position needs the same number of candidates")
            with self._lock:
                if adapter is not None and adapter not in self._adapters:
                    raise EngineError(f"adapter {adapter!r} is not loaded")
                if adapter is not None:
                    self._inflight[adapter] += 1
        except EngineError as e:
            reply(None, e)
            return
        try:
            ids = prompt_ids + response_ids
            first = len(prompt_ids) - 1  # the position that predicts response token 0
            cache, parts = Cache(layer_class_to_replicate=KVLayer), []
            for start, end in self._chunks(0, len(ids) - 1):  # the last token predicts nothing asked
                if start:
                    yield
                chunk = torch.tensor([ids[start:end]], dtype=torch.long, device=self.device)
                keep = end - max(start, first)
                out = self._forward(chunk, [adapter], cache, logits_to_keep=max(keep, 1))
                if keep > 0:
                    parts.append(out.logits[0, -keep:].float())
            logp = torch.log_softmax(torch.cat(parts), dim=-1)
            if candidates is not None:
                result = logp.gather(1, torch.tensor(candidates, device=logp.device)).tolist()
            else:
                result = logp.gather(1, torch.tensor(response_ids, device=logp.device).unsqueeze(1)).squeeze(1).tolist()
        except Exception as e:  # reported to the caller, never kills the worker
            reply(None, e)
        else:
            reply(result, None)
        finally:
            self._release(adapter)
