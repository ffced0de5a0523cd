"""The embedded engine's batch: generations decoding together over one left-padded KV cache, and
how each row's next token is drawn."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from clawback.engine import Sampling, Token

from .grammar import GrammarMask

GREEDY_BELOW = 1e-5  # temperatures under this sample greedily, as vLLM and SGLang do


@dataclass(eq=False)
class Generation:
    prompt_ids: list[int]
    sampling: Sampling
    adapter: str | None
    emit: Callable[[Any], object]  # thread-safe put into the consumer's asyncio queue
    cancelled: threading.Event = field(default_factory=threading.Event)
    n_generated: int = 0
    last_token: int = 0  # the next decode step's input
    rng: torch.Generator | None = None
    background: bool = False  # judge and other internal work: yields to serving
    mask: GrammarMask | None = None  # Sampling.constraint, compiled for this stream


GROW = 64  # KV-cache columns added at a time


class KVLayer(DynamicLayer):
    """One layer's keys and values for a batch of rows, in a buffer that grows GROW columns at a
    time: a decode step writes one column in place, where DynamicLayer would copy the whole cache."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.kbuf = key_states.new_zeros(*key_states.shape[:2], 0, key_states.shape[3])
        self.vbuf = value_states.new_zeros(*value_states.shape[:2], 0, value_states.shape[3])
        self.n = 0
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.n + key_states.shape[-2]
        if end > self.kbuf.shape[-2]:
            self._place(self.kbuf.shape[0], end + GROW, [(slice(None), self)])
        self.kbuf[:, :, self.n : end] = key_states
        self.vbuf[:, :, self.n : end] = value_states
        self.n = end
        self.keys, self.values = self.kbuf[:, :, :end], self.vbuf[:, :, :end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.n if self.is_initialized else 0

    def _place(self, rows: int, capacity: int, parts: list[tuple[Any, KVLayer]]) -> None:
        """New zeroed buffers of `rows` x `capacity` columns; each (rows, layer) part's used columns
        go to those rows, right-aligned at the end column max(n) (the left padding stays zero, so
        it is finite under the mask)."""
        end = max(kv.n for _, kv in parts)
        k = self.kbuf.new_zeros(rows, self.kbuf.shape[1], capacity, self.kbuf.shape[3])
        v = self.vbuf.new_zeros(rows, self.vbuf.shape[1], capacity, self.vbuf.shape[3])
        for where, kv in parts:
            k[where, :, end - kv.n : end] = kv.kbuf[:, :, : kv.n]
            v[where, :, end - kv.n : end] = kv.vbuf[:, :, : kv.n]
        self.kbuf, self.vbuf, self.n = k, v, end
        self.keys, self.values = k[:, :, :end], v[:, :, :end]

    def append_rows(self, other: KVLayer) -> None:
        b = self.kbuf.shape[0]
        self._place(b + other.kbuf.shape[0], max(self.n, other.n) + GROW,
                    [(slice(0, b), self), (slice(b, None), other)])

    def zero_padding(self, mask: torch.Tensor) -> None:
        """Zero the keys and values of padding columns (which attend to nothing in a prefill and
        may hold anything), so that masking them out stays exact."""
        keep = mask[:, None, :, None].to(self.kbuf.dtype)
        self.kbuf[:, :, : self.n].mul_(keep)
        self.vbuf[:, :, : self.n].mul_(keep)

    def keep_rows(self, rows: torch.Tensor, start: int) -> None:
        """Keep only `rows`, dropping the first `start` columns (padding in every kept row)."""
        self.kbuf, self.vbuf = self.kbuf[rows][:, :, start:], self.vbuf[rows][:, :, start:]
        self.n -= start
        self.keys, self.values = self.kbuf[:, :, : self.n], self.vbuf[:, :, : self.n]


class Batch:
    """Generations decoded together: one KV cache, left-padded so that every row's last token
    sits in the same column; `mask` marks each row's real columns."""

    def __init__(self) -> None:
        self.pending: list[Generation] = []  # not prefilled yet
        self.gens: list[Generation] = []  # row i of the cache is gens[i]
        self.cache: Any = None
        self.mask: torch.Tensor | None = None  # [rows, columns], 1 = a real token

    def __len__(self) -> int:
        return len(self.pending) + len(self.gens)

    def merge(self, other: Batch) -> None:
        """Append another batch's rows after this one's."""
        if not self.gens:
            self.gens, self.cache, self.mask = other.gens, other.cache, other.mask
            return
        if not other.gens:
            return
        assert self.mask is not None and other.mask is not None  # rows always come with their mask
        end = max(self.mask.shape[1], other.mask.shape[1])
        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            mine.append_rows(theirs)
        self.mask = torch.cat([pad_left(self.mask, end), pad_left(other.mask, end)])
        self.gens = self.gens + other.gens

    def remove(self, gone: set[Generation]) -> None:
        keep = [i for i, g in enumerate(self.gens) if g not in gone]
        if len(keep) == len(self.gens):
            return
        self.gens = [self.gens[i] for i in keep]
        if not keep:
            self.cache = self.mask = None
            return
        assert self.mask is not None
        rows = torch.tensor(keep, device=self.mask.device)
        mask = self.mask[rows]
        start = int(mask.any(0).int().argmax())  # columns before it are padding in every kept row
        self.mask = mask[:, start:]
        for kv in self.cache.layers:
            kv.keep_rows(rows, start)


def pad_left(mask: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(mask, (width - mask.shape[1], 0))


END = object()


def pick_token(gen: Generation, logits: torch.Tensor, logp: torch.Tensor) -> Token:
    """Sample one stream's next token from its logits row: through its grammar mask if it has
    one; logprobs (and the top-k) are read from the unmasked row's log_softmax `logp`."""
    token_id, sampled = sample(gen.mask.apply(logits) if gen.mask else logits, gen.sampling, gen.rng)
    if gen.mask:
        gen.mask.advance(token_id)
    k = gen.sampling.top_logprobs
    if not k:
        return Token(token_id, float(logp[token_id]), sampling_logprob=sampled)
    top = torch.topk(logp, k)
    return Token(token_id, float(logp[token_id]), tuple(top.indices.tolist()), tuple(top.values.tolist()), sampled)

def sample(logits: torch.Tensor, sampling: Sampling, rng: torch.Generator | None) -> tuple[int, float | None]:
    """The drawn token and its logprob under the distribution it was drawn from (None: greedy)."""
    if sampling.temperature < GREEDY_BELOW:  # a tiny temperature is greedy (and 1/T overflows)
        return int(torch.argmax(logits)), None
    probs = torch.softmax(logits / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < sampling.top_p
        keep[0] = True  # the top token always (a top_p under float32's range compares as 0)
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
        probs = probs / probs.sum()  # what is drawn from
    # Inverse CDF: one uniform draw, where torch.multinomial draws an exponential per
    # vocabulary entry (0.7 ms a row for a 49k vocabulary, bench/README.md). `right` skips
    # the flat steps of zero-probability tokens.
    cdf = torch.cumsum(probs, dim=-1)
    u = torch.rand((), generator=rng, device=probs.device)
    token_id = int(torch.searchsorted(cdf, u * cdf[-1], right=True))
    if token_id == len(cdf):  # u * total rounded up to the total: the last token that can be drawn
        token_id = int(probs.nonzero()[-1])
    return token_id, float(torch.log(probs[token_id]))
