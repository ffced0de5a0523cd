"""Constrained decoding for the embedded engine with llguidance.

A `GrammarMask` belongs to one stream: before each sampling step it masks that stream's logits
row to the tokens that keep the reply valid under its `Constraint`, and it advances with every
token the stream samples. Once the grammar is complete only the end token stays allowed, so the
reply still ends the way the model ends replies.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from clawback.engine import Constraint, EngineError


def check(constraint: Constraint) -> str:
    """An error message when the constraint cannot be compiled ('' when it can); no tokenizer needed."""
    from llguidance import LLMatcher

    return LLMatcher.validate_grammar(LLMatcher.grammar_from_lark(constraint.lark()))


class GrammarTokenizer:
    """llguidance's view of a transformers tokenizer, built once (about 2 s) on first use."""

    def __init__(self, model_dir: str, vocab_size: int) -> None:
        self.model_dir, self.vocab_size = model_dir, vocab_size
        self._lock = threading.Lock()
        self._tokenizer: Any = None

    def get(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf
                from transformers import AutoTokenizer

                hf = AutoTokenizer.from_pretrained(self.model_dir)
                self._tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=self.vocab_size)
            return self._tokenizer


class GrammarMask:
    """The per-stream logits processor: `apply` before sampling, `advance` with the sampled token."""

    def __init__(self, tokenizer: Any, constraint: Constraint) -> None:
        from llguidance import LLMatcher
        from llguidance.torch import allocate_token_bitmask

        self.matcher = LLMatcher(tokenizer, LLMatcher.grammar_from_lark(constraint.lark()))
        if self.matcher.is_error():
            raise EngineError(f"invalid constraint: {self.matcher.get_error()}")
        self.bitmask = allocate_token_bitmask(1, tokenizer.vocab_size)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """A masked copy of one stream's logits row (the row itself is left as the model gave it)."""
        from llguidance.torch import apply_token_bitmask_inplace, fill_next_token_bitmask

        fill_next_token_bitmask(self.matcher, self.bitmask)
        masked = logits.unsqueeze(0).clone()
        apply_token_bitmask_inplace(masked, self.bitmask.to(masked.device))
        return masked[0]

    def advance(self, token_id: int) -> None:
        if not self.matcher.consume_token(token_id):
            raise EngineError(f"token {token_id} rejected by the grammar: {self.matcher.get_error()}")
