"""Constrained decoding for the embedded engine with llguidance.

A `GrammarMask` belongs to one stream: before each sampling step it masks that stream's logits
row to the tokens that keep the reply valid under its `Constraint`, and it advances with every
token the stream samples. Once the grammar is complete only the end token stays allowed, so the
reply still ends the way the model ends replies.
"""

from __future__ import annotations

import json
import threading
from typing import TYPE_CHECKING
from urllib.parse import unquote

import torch

from clawback.engine import Constraint, EngineError

if TYPE_CHECKING:
    from llguidance import LLTokenizer

MAX_SCHEMA_PARTS = 10_000  # subschemas visited with every local $ref expanded


def check(constraint: Constraint) -> str:
    """An error message when the constraint cannot be compiled ('' when it can); no tokenizer needed.

    A recursive schema (a `$ref` to a schema that encloses it, such as "#") is refused first: it
    compiles, but llguidance's grammar for it grows while a reply is generated until it gives up
    mid-generation. So is one whose `$ref`s expand to more than MAX_SCHEMA_PARTS parts."""
    from llguidance import LLMatcher

    error = _schema_problem(json.loads(constraint.schema))
    if error:
        return error
    return LLMatcher.validate_grammar(LLMatcher.grammar_from_lark(constraint.lark()))


def _schema_problem(root: object) -> str:
    """'' for a schema without recursion whose local $refs expand to a bounded size, else why not."""
    visited = 0

    def resolve(pointer: str) -> object:
        node = root
        for part in pointer.split("/")[1:]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None  # a dangling pointer: llguidance says so in its own words
        return node

    def walk(node: object, path: str, expanding: tuple[str, ...]) -> str:
        nonlocal visited
        visited += 1
        if visited > MAX_SCHEMA_PARTS:
            return f"the schema's $refs expand to more than {MAX_SCHEMA_PARTS} parts"
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#"):
                target = unquote(ref[1:])
                if any(p == target or p.startswith(target + "/") for p in (*expanding, path)):
                    return f"recursive schema: $ref {ref[:100]!r} at {path or '/'} refers to a schema that encloses it"
                if (sub := resolve(target)) is not None and (error := walk(sub, target, (*expanding, path))):
                    return error
            items = node.items()
        elif isinstance(node, list):
            items = enumerate(node)
        else:
            return ""
        for key, value in items:
            if isinstance(value, (dict, list)) and (error := walk(value, f"{path}/{key}", expanding)):
                return error
        return ""

    return walk(root, "", ())


class GrammarTokenizer:
    """llguidance's view of a transformers tokenizer, built once (about 2 s) on first use."""

    def __init__(self, model_dir: str, vocab_size: int) -> None:
        self.model_dir, self.vocab_size = model_dir, vocab_size
        self._lock = threading.Lock()
        self._tokenizer: LLTokenizer | None = None

    def get(self) -> LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf
                from transformers import AutoTokenizer

                hf = AutoTokenizer.from_pretrained(self.model_dir)
                self._tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=self.vocab_size)
            return self._tokenizer


class GrammarMask:
    """The per-stream logits processor: `apply` before sampling, `advance` with the sampled token."""

    def __init__(self, tokenizer: LLTokenizer, constraint: Constraint) -> None:
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
