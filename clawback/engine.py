"""The engine interface: what the daemon serves with and the judge votes with.

Implementations live in `clawback.engines` (embedded transformers+PEFT; vLLM and SGLang
over HTTP). Every engine generates from exact prompt
token ids and reports, for each sampled token, its id and its logprob under the *unscaled*
(temperature 1, no top-p) distribution of the model that served it. Those logprobs are the
behaviour logprobs that training uses, so `score()` on the same ids must reproduce them.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol


@dataclass(frozen=True)
class Constraint:
    """What a reply must match: a JSON value valid under `schema` (JSON Schema, as JSON text),
    between a fixed `prefix` and `suffix` (a forced tool call: `<tool_call>\n` … `\n</tool_call>`).

    JSON is written compactly (`, ` and `: ` separators, no other whitespace) so that a small
    model cannot spend its tokens on blank space."""

    schema: str
    prefix: str = ""
    suffix: str = ""

    def lark(self) -> str:
        """The constraint as an llguidance Lark grammar."""
        schema = json.loads(self.schema)
        schema = {**schema, "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}
        parts = [json.dumps(p) for p in (self.prefix,) if p] + ["value"] + [json.dumps(s) for s in (self.suffix,) if s]
        return f"start: {' '.join(parts)}\nvalue: %json {json.dumps(schema)}\n"


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    max_tokens: int = 256
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()  # end the generation after emitting one of these
    top_logprobs: int = 0  # report the k most likely tokens at each position (Token.top_ids / top_logprobs)
    constraint: Constraint | None = None  # sample only tokens that keep the reply valid under it


@dataclass(frozen=True)
class Token:
    """One sampled token. `logprob` and `top_logprobs` are of the model's unscaled distribution
    (temperature 1, no top-p, no grammar mask): what `score()` reproduces and training uses.
    `top_ids` / `top_logprobs` are the `Sampling.top_logprobs` most likely tokens at this position,
    most likely first (empty when not asked for); the sampled token may or may not be among them."""

    id: int
    logprob: float  # under the unscaled (temperature-1) distribution
    # The k most likely tokens at this position and their temperature-1 logprobs, most likely
    # first; empty unless Sampling.top_logprobs asked for them.
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()
    # Logprob under the distribution the token was actually drawn from (temperature, top-p and a
    # constraint's mask applied); None for greedy decoding or an engine that cannot report it.
    sampling_logprob: float | None = None


@dataclass(frozen=True)
class ModelInfo:
    name: str
    context_length: int
    eos_token_ids: tuple[int, ...]
    n_params: int = 0


class EngineError(RuntimeError):
    pass


class Engine(Protocol):
    info: ModelInfo

    async def start(self) -> None:
        """Launch or reach the model server (vLLM, SGLang); the embedded engine has nothing to do."""
        ...

    def generate(
        self, prompt_ids: Sequence[int], sampling: Sampling, adapter: str | None = None, *, background: bool = False
    ) -> AsyncGenerator[Token, None]:
        """Stream sampled tokens. Closing the iterator early cancels the generation.

        `background` work (the judge) yields to requests being served."""
        ...

    async def score(
        self, prompt_ids: Sequence[int], response_ids: Sequence[int], adapter: str | None = None
    ) -> list[float]:
        """Logprob of each response token given the prompt and the tokens before it."""
        ...

    async def score_candidates(
        self, prompt_ids: Sequence[int], response_ids: Sequence[int], candidates: Sequence[Sequence[int]],
        adapter: str | None = None,
    ) -> list[list[float]]:
        """Logprob of each candidate token id at each response position (candidates[t] at position
        t, given the prompt and response_ids[:t]): a teacher's view of the student's top-K."""
        ...

    async def load_adapter(self, version: str, path: str) -> None: ...

    async def activate(self, version: str | None) -> None:
        """Route new requests to `version` (None = base model); in-flight ones keep theirs."""
        ...

    async def unload(self, version: str) -> None: ...

    def active_version(self) -> str | None: ...

    def loaded_versions(self) -> list[str]:
        """Adapter versions loaded and not being retired."""
        ...

    def running(self) -> int:
        """Generations under way."""
        ...

    async def close(self) -> None: ...




def read_model_info(model_dir: str | Path, name: str | None = None) -> ModelInfo:
    """Name, context length, end tokens and parameter count without loading the weights."""
    from transformers import AutoConfig, GenerationConfig

    config = AutoConfig.from_pretrained(str(model_dir))
    eos = config.eos_token_id
    try:  # generation_config.json often lists more end tokens (e.g. <|im_end|>) than config.json
        gen_eos = GenerationConfig.from_pretrained(str(model_dir)).eos_token_id
        eos = gen_eos if gen_eos is not None else eos
    except OSError:
        pass
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
    return ModelInfo(
        name=name or Path(str(model_dir)).name,
        context_length=int(getattr(config, "max_position_embeddings", 2048)),
        eos_token_ids=eos_ids,
        n_params=_count_params(Path(model_dir)),
    )


def _count_params(model_dir: Path) -> int:
    """Sum of tensor sizes from the safetensors headers (a few KB read, no weights)."""
    import struct

    total = 0
    for f in model_dir.glob("*.safetensors"):
        with f.open("rb") as fh:
            header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
        for key, t in header.items():
            if key != "__metadata__":
                n = 1
                for d in t["shape"]:
                    n *= d
                total += n
    return total


@dataclass(frozen=True)
class EngineConfig:
    """What an engine is built from: the daemon's settings for it (daemon/config.py `Settings`,
    whose comments say what each means) and the LoRA the trainer trains, which a vLLM or SGLang
    server is sized for."""

    kind: Literal["embedded", "vllm", "sglang"]
    device: str
    dtype: str
    torch_threads: int
    served_model_name: str
    url: str | None  # attach to this server instead of launching one
    api_key: str | None
    python: str | None
    command: str | None
    args: str
    port: int  # 0 = a free one
    mem_fraction: float
    kv_cache_gib: float
    start_timeout_s: float
    log_dir: Path  # a launched server's log goes here
    lora_rank: int
    lora_target_modules: str | tuple[str, ...]
