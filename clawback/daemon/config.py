"""The one settings object: defaults < clawback.toml < CLAWBACK_* env vars < CLI flags.

Built once at start, frozen, and passed down explicitly.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic.dataclasses import dataclass as pydantic_dataclass
from pydantic_core import ArgsKwargs
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from clawback.engine import EngineConfig
from clawback.trainer.config import PRESETS, TrainConfig

from .layout import Layout
from .outcomes import RULES

# The catalogue's smallest model (daemon/models.py): the fast test tier and tiny machines.
EMBEDDED_MODEL = "smollm2-135m-instruct"
# What `serve` and `simulate` use unless told otherwise, chosen by measurement (bench/README.md).
DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct"


class GateConfig(BaseModel):
    """The `[gate]` table of clawback.toml: the candidate gate and the live guard (docs/gate.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = True  # false: every trained version goes live as soon as it loads
    # training health
    grad_spike: float = Field(default=10.0, gt=1)  # × running median gradient norm of healthy steps
    loss_spike: float = Field(default=10.0, gt=1)  # × running median |loss| of healthy steps ...
    loss_floor: float = Field(default=5.0, ge=0)  # ... and |loss| above this (RL losses hover near 0)
    health_window: int = Field(default=20, ge=1)  # healthy steps in the running medians
    health_min_steps: int = Field(default=3, ge=1)  # spike checks start once this many steps are known
    # capability retention
    probes: int = Field(default=0, ge=0)  # probes used, 0 = the whole set
    probe_max_tokens: int = Field(default=32, ge=4)
    # Refused when the changed probes go against the candidate beyond chance (one-sided exact sign
    # test, p < retention_alpha) and it is at least retention_margin points (of 100) below the base.
    retention_alpha: float = Field(default=0.05, gt=0, le=1)
    retention_margin: float = Field(default=2.0, ge=0)
    # collapse detectors (candidate against live, on the probe replies)
    entropy_low: float = Field(default=0.3, ge=0)  # min-entropy below this × live's: collapsed
    entropy_high: float = Field(default=3.0, ge=1)  # above this × live's + 0.5 nats: blown up
    distinct_drop: float = Field(default=0.25, ge=0)  # distinct-2 more than this below live's
    similarity_rise: float = Field(default=0.25, ge=0)  # cross-reply similarity more than this above live's
    length_ratio: float = Field(default=2.5, gt=1)  # median length outside [live/ratio, live×ratio] ...
    length_min_change: int = Field(default=8, ge=0)  # ... and at least this many tokens apart
    empty_rise: float = Field(default=0.15, ge=0)  # empty-reply share more than this above live's
    cut_rise: float = Field(default=0.25, ge=0)  # cut-reply share this much or more above live's
    loop_rise: float = Field(default=0.15, ge=0)  # share of replies ending in a repetition loop
    repeat_rise: float = Field(default=0.15, ge=0)  # share of replies that say one sentence twice
    meta_rise: float = Field(default=0.15, ge=0)  # share of replies about the conversation itself
    refusal_rise: float = Field(default=0.15, ge=0)  # share of replies that decline the task
    # share of replies to requests offering tools that make no call an agent could run (your requests)
    tool_call_drop: float = Field(default=0.25, ge=0)
    # preference replay
    held_out_share: float = Field(default=0.2, ge=0, lt=1)  # of rated calls, never trained on
    replay_calls: int = Field(default=32, ge=0)  # newest held-out calls replayed per candidate
    replay_min_each: int = Field(default=2, ge=1)  # liked and disliked calls needed for the margin check
    replay_tolerance: float = Field(default=0.05, ge=0)  # nats/token the candidate may lose against live
    replay_max_tokens: int = Field(default=16384, ge=16)  # longer calls are not replayed (one forward each)
    # The newest held-out calls' own prompts (as served, preference notes included) answered
    # greedily by candidate and live for the collapse detectors; 0 = probes only.
    replay_generate: int = Field(default=8, ge=0)
    replay_generate_tokens: int = Field(default=64, ge=8)
    # the notes still followed: the newest notes_calls liked replies served with the person's notes
    # (0 = off), on the tokens the notes lead the base model to (at least notes_lead nats more
    # likely with them than without); refused when the candidate, told, puts more than
    # notes_tolerance nats/token less on them than live
    notes_calls: int = Field(default=8, ge=0)
    notes_lead: float = Field(default=1.0, gt=0)
    notes_tolerance: float = Field(default=0.5, ge=0)
    # live guard after activation (guard.py)
    guard_replies: int = Field(default=20, ge=0)  # main replies watched per version, 0 = off
    guard_alpha: float = Field(default=0.05, gt=0, lt=1)  # significance of Fisher's one-sided exact test
    guard_baseline: int = Field(default=200, ge=1)  # newest replies of the previous version compared against


class OutcomeSettings(BaseModel):
    """`[signals.outcomes]`: rewards that tool results and scripted environments state, without
    a judge (daemon/outcomes.py; docs/protocol.md, "Outcomes")."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = True  # read the rules' outcomes off tool results (outcome events count either way)
    # The rules, in the order they are tried on each tool result; the first that recognises it decides.
    rules: tuple[str, ...] = tuple(RULES)
    success_reward: float = Field(default=1.0, ge=-1.0, le=1.0)
    failure_reward: float = Field(default=-1.0, ge=-1.0, le=1.0)
    # How an outcome event that does not say is credited across its trajectory's main calls:
    # last = the final call, every = each call, step = per step index within the event's group.
    credit: Literal["last", "every", "step"] = "last"

    @field_validator("rules")
    @classmethod
    def _known_rules(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        unknown = [r for r in v if r not in RULES]
        if unknown:
            raise ValueError(f"no outcome rule {', '.join(unknown)}; the rules are {', '.join(RULES)}")
        return v


class SignalsSettings(BaseModel):
    """`[signals]`: where rewards come from besides a person and the judge."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    outcomes: OutcomeSettings = Field(default_factory=lambda: OutcomeSettings())


def default_data_dir() -> Path:
    return Path(os.environ.get("CLAWBACK_DATA_DIR") or Path.home() / ".clawback")


@dataclass(frozen=True)
class PresetSignals:
    """The sample-building half of a preset (its training half is clawback.trainer.config.PRESETS):
    what [train] teacher / count_zero_signal and [judge] context are when they are not given."""

    teacher: Literal["self", "base"] = "self"
    judge_context: Literal["full", "response_only"] = "full"
    count_zero_signal: bool = False


# "seed", the original OpenClaw-RL recipe: the teacher is the frozen base model + hint, the judge
# sees only the reply and its next state, and samples without a signal count toward the batch.
PRESET_SIGNALS: dict[str, PresetSignals] = {
    "seed": PresetSignals(teacher="base", judge_context="response_only", count_zero_signal=True),
}


@pydantic_dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class TrainSettings(TrainConfig):
    """`[train]`: whether and how the daemon trains.

    Besides the fields below it takes every field of `TrainConfig` (clawback/trainer/config.py,
    where each is documented: `lr`, `tis_cap`, `kl_coef`, `weight_decay`, `batch_size`,
    `lora_rank`, `method`, ...): `preset` gives their values, and one given here overrides its
    preset's.
    """

    enabled: bool = True  # train in the background once batch_size samples are ready
    preset: Literal["binary", "opd", "combined", "seed"] = "combined"
    # self = current policy + hint (the paper); base = frozen base + hint. None = the preset's (seed: base, else self).
    teacher: Literal["self", "base"] | None = None
    # Keep samples without any signal as ready with reward 0, so they count toward the batch (the
    # original project's Binary RL did); else they are dropped with reason no_signal. None = the preset's.
    count_zero_signal: bool | None = None
    keep_versions: int = Field(default=5, ge=1)  # retention: the newest K good versions, plus pinned and live
    device: str = "auto"  # the trainer's torch device
    threads: int = Field(default=0, ge=0)  # torch threads of the trainer; 0 = from the CPU budget (see torch_threads)
    # How the person's correction reaches the OPD teacher (daemon/samples.py HINT_TEMPLATES): its
    # wording, and whether it goes into the last user message or the system prompt
    # (bench/README.md, "In-context following").
    hint_template: Literal["instruction", "hint"] = "hint"
    hint_placement: Literal["user", "system"] = "user"
    # A reply cut by the token budget is no finished answer: drop its sample (reason cut_off). Off
    # by default: a person's rating of a cut reply is still their signal about it.
    drop_cut_replies: bool = False
    # The reward of a reply the person corrected without a 👍 or 👎, when no judge scores it
    # (the judge is off below 1B parameters). −1 reads a typed correction as a 👎, so Binary RL,
    # and the reward half of combined, learn from a person who types rather than taps. 0: such a
    # reply trains only through the OPD teacher under the correction (Binary RL drops it).
    correction_reward: float = Field(default=0.0, ge=-1.0, le=1.0)

    @model_validator(mode="before")
    @classmethod
    def _preset_under_the_table(cls, data: object) -> object:
        """The preset's TrainConfig values wherever the table gives none. Without a preset the
        fields' own defaults stand: they are the default preset, combined."""
        if isinstance(data, ArgsKwargs):  # TrainSettings(preset=...) called directly
            data = data.kwargs or {}
        if isinstance(data, dict) and data.get("preset") in PRESETS:
            return {**dataclasses.asdict(PRESETS[data["preset"]]), **data}
        return data

    def config(self) -> TrainConfig:
        """The trainer's part of the table."""
        return TrainConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(TrainConfig)})


class JudgeSettings(BaseModel):
    """`[judge]`: who scores next states and distils hints."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # auto = url if set, else the policy engine (base model, no adapter) for models of 1B+
    # parameters; smaller ones (the embedded 135M model) judge near chance (bench/README.md), so
    # there explicit feedback is the signal and the judge is opt-in.
    backend: Literal["auto", "engine", "openai", "off"] = "auto"
    url: str | None = None  # any OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000/v1
    api_key: SecretStr | None = None
    model: str | None = None
    votes: int = Field(default=3, ge=1)  # odd, so that a majority always exists
    temperature: float = Field(default=0.6, ge=0, le=2)
    max_tokens: int = Field(default=512, ge=16)
    timeout_s: float = Field(default=120.0, gt=0)
    retries: int = Field(default=1, ge=0)
    concurrency: int = Field(default=2, ge=1)  # samples judged at once
    # full = the judge sees the request and recent context; response_only = only the reply and
    # its next state, as the original OpenClaw-RL judge. None = the preset's (seed: response_only).
    context: Literal["full", "response_only"] | None = None

    @field_validator("votes")
    @classmethod
    def _odd(cls, v: int) -> int:
        if v % 2 == 0:
            raise ValueError("judge votes must be odd so that a majority always exists")
        return v


@dataclass(frozen=True)
class SignalConfig:
    """What the sample pipeline needs, resolved from the settings (`Settings.signal_config`, where
    each comes from)."""

    method: Literal["binary", "opd", "combined"]
    teacher: Literal["self", "base"]
    judge_votes: int
    judge_temperature: float
    judge_max_tokens: int
    judge_timeout_s: float
    judge_retries: int
    concurrency: int
    judge_context: Literal["full", "response_only"]
    count_zero_signal: bool
    hint_template: Literal["instruction", "hint"]
    hint_placement: Literal["user", "system"]
    # Positive evidence: also generate the teacher's own (greedy) reply under the hint, so that a
    # preference the policy never samples can still be learned (TrainConfig.evidence_weight > 0).
    positive_evidence: bool
    drop_cut_replies: bool  # see TrainSettings
    train_loops: bool  # a looping reply marked wrong trains against its loop (TrainConfig.loop_penalty > 0)
    correction_reward: float  # see TrainSettings
    # A reply served with preference notes trains in its request without them (see Settings.memory_consolidate).
    consolidate_notes: bool
    # Outcome rules tried on each tool result, in order (outcomes.py; empty = off), and their rewards.
    outcome_rules: tuple[str, ...]
    outcome_success: float
    outcome_failure: float


# The flat keys of earlier versions and where each lives now, as (table, key). They are refused,
# naming their new place, wherever they are given: toml, CLAWBACK_* env vars, keyword arguments.
MOVED_KEYS: dict[str, tuple[str, str]] = {
    "train": ("train", "enabled"), "method": ("train", "method"), "teacher": ("train", "teacher"),
    "count_zero_signal": ("train", "count_zero_signal"), "batch_size": ("train", "batch_size"),
    "lr": ("train", "lr"), "lora_rank": ("train", "lora_rank"), "lora_alpha": ("train", "lora_alpha"),
    "micro_batch_tokens": ("train", "micro_batch_tokens"), "max_staleness": ("train", "max_staleness"),
    "keep_versions": ("train", "keep_versions"), "trainer_device": ("train", "device"),
    "trainer_threads": ("train", "threads"),
    "judge": ("judge", "backend"), "judge_url": ("judge", "url"), "judge_api_key": ("judge", "api_key"),
    "judge_model": ("judge", "model"), "judge_votes": ("judge", "votes"),
    "judge_temperature": ("judge", "temperature"), "judge_max_tokens": ("judge", "max_tokens"),
    "judge_timeout_s": ("judge", "timeout_s"), "judge_retries": ("judge", "retries"),
    "judge_concurrency": ("judge", "concurrency"), "judge_context": ("judge", "context"),
}


def _moved(flat: str, given_as: str) -> ValueError:
    table, key = MOVED_KEYS[flat]
    return ValueError(f"{given_as} is no longer read (a flat key of earlier versions): give [{table}] {key} in "
                      f"clawback.toml, or CLAWBACK_{table.upper()}__{key.upper()} in the environment")


def _refuse_moved_env_vars() -> None:
    """The env source reads only fields (and would fail to parse CLAWBACK_JUDGE=off as a table),
    so the flat keys' variables are refused here, before it runs."""
    env = {k.upper(): v for k, v in os.environ.items()}
    for flat in MOVED_KEYS:
        value = env.get(f"CLAWBACK_{flat.upper()}")
        # CLAWBACK_TRAIN / CLAWBACK_JUDGE holding a JSON table is the tables' own variable.
        if value is not None and not (flat in ("train", "judge") and value.lstrip().startswith("{")):
            raise _moved(flat, f"CLAWBACK_{flat.upper()}")


class Settings(BaseSettings):
    # CLAWBACK_TRAIN__BATCH_SIZE=2 sets [train] batch_size (and so on for every table).
    model_config = SettingsConfigDict(env_prefix="CLAWBACK_", env_nested_delimiter="__", frozen=True,
                                      extra="forbid")

    # Where clawback.toml is looked for: explicit path, else <data_dir>/clawback.toml, else ./clawback.toml.
    config_file: Path | None = None

    data_dir: Path = Field(default_factory=default_data_dir)
    host: str = "127.0.0.1"
    port: int = Field(30000, ge=0, le=65535)

    # Model: a catalogue name (`clawback models list`), a .gguf file, a local HF model dir, or a hub id
    # where the machine has network.
    model: str = DEFAULT_MODEL
    served_model_name: str = "clawback"
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # torch threads of the embedded engine; 0 = from the CPU budget (clawback.trainer.priority.
    # thread_budget: 1 each for engine and trainer on 1-2 cores, else the cores but one, split)
    torch_threads: int = Field(0, ge=0)

    # Engine: embedded (transformers+PEFT in the daemon), or a model server: vllm / sglang, launched
    # and supervised as a child, or already running at engine_url (docs/engines.md).
    engine: Literal["embedded", "vllm", "sglang"] = "embedded"
    engine_url: str | None = None  # attach to this server instead of launching one (not supervised)
    engine_api_key: SecretStr | None = None  # the attached server's key; a launched one gets a random key
    engine_python: str | None = None  # python that runs the server (vllm: ~/.cache/clawback/vllm-venv)
    engine_command: str | None = None  # launch command instead of `<engine_python> -m <server module>`
    engine_args: str = ""  # extra server flags, appended verbatim (e.g. "--tp 2")
    engine_port: int = Field(0, ge=0, le=65535)  # the launched server's port; 0 = a free one
    engine_mem_fraction: float = Field(0.45, gt=0, lt=1)  # SGLang --mem-fraction-static; the rest is the trainer's (docs/memory-plan.md)
    # vLLM on CPU: the KV cache in GiB (VLLM_CPU_KVCACHE_SPACE); 0 = what the model needs for a few
    # full-context sequences, at most engine_mem_fraction of the memory available at start.
    engine_kv_cache_gib: float = Field(0, ge=0)
    engine_start_timeout_s: float = Field(900.0, gt=0)  # first start loads weights and may compile

    # Auth: a key given here wins; otherwise <data_dir>/api_key (created on first start).
    api_key: SecretStr | None = None
    no_auth: bool = False

    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    default_max_tokens: int = Field(1024, ge=1)

    session_idle_timeout_s: float = Field(1800.0, gt=0)
    session_sweep_interval_s: float = Field(30.0, gt=0)
    session_cache_size: int = Field(10_000, ge=1)

    store_queue_size: int = Field(10_000, ge=1)
    # A client that takes longer than this to send a request head, or stalls this long inside a
    # body, is cut off (a stalled socket would otherwise stay open for good).
    client_timeout_s: float = Field(10.0, gt=0)
    # Forget sessions last seen more than this many days ago (as `clawback forget --before`); 0 = keep.
    retain_days: float = Field(0.0, ge=0)

    # Preference notes from corrections and 👎 reasons, injected into main calls' last user message
    # or system prompt (memory_placement; daemon/memory.py); at most memory_max_notes are kept. With memory_retire, a note the live
    # version follows without it (its teacher gap at most the note's own on the base model minus
    # memory_retire_margin nats/token) is no longer injected while that version serves
    # (daemon/retirement.py).
    memory: bool = True
    memory_placement: Literal["user", "system"] = "user"
    memory_max_notes: int = Field(8, ge=1)
    memory_retire: bool = True
    memory_retire_margin: float = Field(0.0, ge=0)
    # Note consolidation: a reply served with notes, unless disliked, trains in its request without
    # them, against the serving version's logprobs there, and is distilled (TrainConfig.distill_weight), so the
    # weights learn to do untold what the notes asked for (daemon/samples.py `_consolidate`).
    # Off (the default): it trains with the notes it was served with. On adapted in 1 of 6 runs on
    # `sure` (later than off in 2 seeds, sooner in none; not decided), no better than the notes
    # alone, and retired no note (bench/README.md, "Training without the notes").
    memory_consolidate: bool = False

    # [train] and [judge]: what the daemon learns from and how (TrainSettings, JudgeSettings above).
    train: TrainSettings = Field(default_factory=lambda: TrainSettings())
    judge: JudgeSettings = Field(default_factory=lambda: JudgeSettings())
    ray_address: str | None = None  # join an existing Ray cluster; default: a local Ray runtime
    layout: Layout = Field(default_factory=lambda: Layout())  # [layout]: where engine, judge and trainer run (daemon/layout.py)
    gate: GateConfig = Field(default_factory=lambda: GateConfig())  # [gate]: checks before and after a version goes live
    signals: SignalsSettings = Field(default_factory=lambda: SignalsSettings())  # [signals]: outcome rewards

    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @model_validator(mode="before")
    @classmethod
    def _no_moved_keys(cls, data: object) -> object:
        if isinstance(data, dict):
            for flat in MOVED_KEYS.keys() & data.keys():
                # `train = false`, `judge = "off"`: a table's name given one value, not the table
                if flat not in ("train", "judge") or isinstance(data[flat], bool | str):
                    raise _moved(flat, flat)
        return data

    @field_validator("engine_url")
    @classmethod
    def _http_url(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("http://", "https://")):
            raise ValueError("engine_url must be an http:// or https:// URL")
        return v

    @field_validator("data_dir", mode="after")
    @classmethod
    def _expand(cls, v: Path) -> Path:
        return v.expanduser()

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Earlier sources win: CLI flags (init kwargs) > env > toml > field defaults.
        _refuse_moved_env_vars()
        toml_path = _find_toml(init_settings, env_settings)
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if toml_path is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=toml_path))
        return tuple(sources)

    def train_config(self) -> TrainConfig:
        return self.train.config()

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            kind=self.engine, device=self.device, dtype=self.dtype, torch_threads=self.torch_threads,
            served_model_name=self.served_model_name, url=self.engine_url,
            api_key=self.engine_api_key.get_secret_value() if self.engine_api_key else None,
            python=self.engine_python, command=self.engine_command, args=self.engine_args, port=self.engine_port,
            mem_fraction=self.engine_mem_fraction, kv_cache_gib=self.engine_kv_cache_gib,
            start_timeout_s=self.engine_start_timeout_s, log_dir=self.data_dir / "logs",
            lora_rank=self.train.lora_rank, lora_target_modules=self.train.target_modules)

    def signal_config(self) -> SignalConfig:
        """How the sample pipeline builds samples: the [judge] table and the preset's choices."""
        j, preset = self.judge, PRESET_SIGNALS.get(self.train.preset, PresetSignals())
        return SignalConfig(
            method=self.train.method,
            teacher=self.train.teacher or preset.teacher,
            count_zero_signal=(self.train.count_zero_signal if self.train.count_zero_signal is not None
                               else preset.count_zero_signal),
            judge_context=j.context or preset.judge_context,
            hint_template=self.train.hint_template,
            hint_placement=self.train.hint_placement, drop_cut_replies=self.train.drop_cut_replies,
            correction_reward=self.train.correction_reward,
            consolidate_notes=self.memory and self.memory_consolidate,
            positive_evidence=self.train.evidence_weight > 0,
            train_loops=self.train.loop_penalty > 0,
            judge_votes=j.votes, judge_temperature=j.temperature, judge_max_tokens=j.max_tokens,
            judge_timeout_s=j.timeout_s, judge_retries=j.retries, concurrency=j.concurrency,
            outcome_rules=self.signals.outcomes.rules if self.signals.outcomes.enabled else (),
            outcome_success=self.signals.outcomes.success_reward, outcome_failure=self.signals.outcomes.failure_reward)

    @property
    def db_path(self) -> Path:
        return self.data_dir / "clawback.db"

    @property
    def api_key_path(self) -> Path:
        return self.data_dir / "api_key"

    @property
    def models_dir(self) -> Path:
        return self.data_dir / "models"

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"


def _find_toml(init: PydanticBaseSettingsSource, env: PydanticBaseSettingsSource) -> Path | None:
    def pick(key: str) -> Path | None:  # a flag before its env var
        value = init().get(key) or env().get(key)
        return Path(value).expanduser() if value else None

    explicit = pick("config_file")
    if explicit:
        if not explicit.is_file():
            raise FileNotFoundError(f"config file not found: {explicit}")
        return explicit
    data_dir = pick("data_dir") or default_data_dir().expanduser()
    for candidate in (data_dir / "clawback.toml", Path.cwd() / "clawback.toml"):
        if candidate.is_file():
            return candidate
    return None


def load_settings(**cli_flags: Any) -> Settings:  # Any: pydantic checks each flag against its field
    """Build settings; CLI flags that were not given (None) do not override anything."""
    return Settings(**{k: v for k, v in cli_flags.items() if v is not None})
