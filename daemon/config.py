"""The one settings object: defaults < clawback.toml < CLAWBACK_* env vars < CLI flags.

Built once at start, frozen, and passed down explicitly.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from .layout import Layout

EMBEDDED_MODEL = "smollm2-135m-instruct"


def default_data_dir() -> Path:
    return Path(os.environ.get("CLAWBACK_DATA_DIR") or Path.home() / ".clawback")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CLAWBACK_", frozen=True, extra="forbid")

    # Where clawback.toml is looked for: explicit path, else <data_dir>/clawback.toml, else ./clawback.toml.
    config_file: Path | None = None

    data_dir: Path = Field(default_factory=default_data_dir)
    host: str = "127.0.0.1"
    port: int = Field(30000, ge=0, le=65535)

    # Model: the embedded alias, a local HF model dir, or a hub id where the machine has network.
    model: str = EMBEDDED_MODEL
    served_model_name: str = "clawback"
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    torch_threads: int = Field(0, ge=0)  # 0 = torch's default

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

    # Signals -> samples -> training. The loss knobs live in clawback.trainer.config.TrainConfig;
    # the ones below are the ones worth setting per install.
    method: Literal["binary", "opd", "combined"] = "combined"
    teacher: Literal["self", "base"] = "self"  # self = current policy + hint (the paper); base = frozen base + hint
    # auto = judge_url if set, else the policy engine (base model, no adapter) for models of 1B+
    # parameters; smaller ones (the embedded 135M model) judge near chance (bench/README.md), so
    # there explicit feedback is the signal and the judge is opt-in.
    judge: Literal["auto", "engine", "openai", "off"] = "auto"
    judge_url: str | None = None  # any OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000/v1
    judge_api_key: SecretStr | None = None
    judge_model: str | None = None
    judge_votes: int = Field(3, ge=1)
    judge_temperature: float = Field(0.6, ge=0, le=2)
    judge_max_tokens: int = Field(512, ge=16)
    judge_timeout_s: float = Field(120.0, gt=0)
    judge_retries: int = Field(1, ge=0)
    judge_concurrency: int = Field(2, ge=1)
    # full = the judge sees the request and recent context; response_only = only the reply and
    # its next state, as the original OpenClaw-RL judge (the `seed` recipe).
    judge_context: Literal["full", "response_only"] = "full"
    # Keep samples without any signal as ready with reward 0, so they count toward the batch (the
    # original project's Binary RL did); by default they are dropped with reason no_signal.
    count_zero_signal: bool = False

    # How the person's correction reaches the teacher (daemon/samples.py HINT_TEMPLATES): its wording,
    # and whether it goes into the last user message or the system prompt. Chosen by measurement
    # (bench/README.md, "In-context following").
    hint_template: Literal["instruction", "hint"] = "instruction"
    hint_placement: Literal["user", "system"] = "user"
    # Preference notes from corrections and 👎 reasons, injected into main calls' system prompt
    # (daemon/memory.py); at most memory_max_notes are kept.
    memory: bool = True
    memory_max_notes: int = Field(8, ge=1)

    train: bool = True  # train in the background once batch_size samples are ready
    batch_size: int = Field(16, ge=1)
    lr: float = Field(1e-4, gt=0)
    lora_rank: int = Field(16, ge=1)
    lora_alpha: int = Field(32, ge=1)
    micro_batch_tokens: int = Field(8192, ge=64)
    max_staleness: int = Field(4, ge=0)
    # Top-K OPD: distil over the policy's K most likely tokens at each response position, each
    # advantage clipped to ±opd_clip nats (trainer/config.py); 0 = token-level OPD on the sampled token.
    opd_top_k: int = Field(4, ge=0, le=20)
    opd_clip: float = Field(1.0, gt=0)
    kl_coef: float = Field(0.0, ge=0)  # KL-to-base anchor per token (trainer/config.py), logged per step as "kl"
    # Positive evidence (opd, combined): > 0 also distils the teacher's own hinted reply into the
    # policy with this advantage per token (trainer/config.py evidence_weight); 0 = off.
    evidence_weight: float = Field(0.0, ge=0)
    keep_versions: int = Field(5, ge=1)  # retention: the newest K good versions, plus pinned and live
    ray_address: str | None = None  # join an existing Ray cluster; default: a local Ray runtime
    layout: Layout = Field(default_factory=Layout)  # [layout]: where engine, judge and trainer run (daemon/layout.py)
    trainer_device: str = "auto"
    trainer_threads: int = Field(1, ge=0)  # torch threads of the trainer (leave cores for serving)

    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @field_validator("judge_votes")
    @classmethod
    def _odd(cls, v: int) -> int:
        if v % 2 == 0:
            raise ValueError("judge_votes must be odd so that a majority always exists")
        return v

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
        toml_path = _find_toml(init_settings, env_settings)
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if toml_path is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=toml_path))
        return tuple(sources)

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
    def pick(source: PydanticBaseSettingsSource, key: str) -> Any:
        return source().get(key)

    explicit = pick(init, "config_file") or pick(env, "config_file")
    if explicit:
        path = Path(explicit).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"config file not found: {path}")
        return path
    data_dir = Path(pick(init, "data_dir") or pick(env, "data_dir") or default_data_dir()).expanduser()
    for candidate in (data_dir / "clawback.toml", Path.cwd() / "clawback.toml"):
        if candidate.is_file():
            return candidate
    return None


def load_settings(**cli_flags: Any) -> Settings:
    """Build settings; CLI flags that were not given (None) do not override anything."""
    return Settings(**{k: v for k, v in cli_flags.items() if v is not None})
