"""Settings: defaults < clawback.toml < CLAWBACK_* env vars < CLI flags; frozen; strict."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from clawback.daemon.config import DEFAULT_MODEL, Settings, TrainSettings, load_settings
from clawback.trainer.config import PRESETS, TrainConfig


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A clean world: no CLAWBACK_* variables, a fake home, and an empty working directory."""
    for key in list(os.environ):
        if key.upper().startswith("CLAWBACK_"):
            monkeypatch.delenv(key)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return home


def write_toml(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_defaults(home: Path) -> None:
    s = load_settings()
    assert s.data_dir == home / ".clawback"
    assert s.db_path == home / ".clawback" / "clawback.db"
    assert s.api_key_path == home / ".clawback" / "api_key"
    assert s.models_dir == home / ".clawback" / "models"
    assert (s.host, s.port, s.base_url) == ("127.0.0.1", 30000, "http://127.0.0.1:30000")
    assert s.model == DEFAULT_MODEL and s.served_model_name == "clawback"
    assert s.config_file is None and s.api_key is None and s.no_auth is False
    assert s.session_idle_timeout_s == 1800.0 and s.store_queue_size == 10_000
    assert not (home / ".clawback").exists()  # loading settings creates nothing


def test_loop_training_is_off_until_loop_penalty_is_set(home: Path) -> None:
    assert not load_settings().signal_config().train_loops
    write_toml(home / ".clawback" / "clawback.toml", "[train]\nloop_penalty = 0.5\n")
    s = load_settings()
    assert s.signal_config().train_loops and s.train_config().loop_penalty == 0.5
    write_toml(home / ".clawback" / "clawback.toml", "[train]\nloop_penalty = -1\n")
    with pytest.raises(ValidationError, match="loop_penalty"):
        load_settings()


def test_correction_reward_reaches_the_sample_pipeline_and_is_bounded(home: Path) -> None:
    assert load_settings().signal_config().correction_reward == 0.0
    write_toml(home / ".clawback" / "clawback.toml", "[train]\ncorrection_reward = -1\nupdates_per_batch = 4\n")
    s = load_settings()
    assert s.signal_config().correction_reward == -1.0 and s.train_config().updates_per_batch == 4
    for bad in ("correction_reward = -2", "updates_per_batch = 0"):
        write_toml(home / ".clawback" / "clawback.toml", f"[train]\n{bad}\n")
        with pytest.raises(ValidationError, match=bad.split()[0]):
            load_settings()


def test_cli_flags_given_as_none_do_not_override(home: Path) -> None:
    s = load_settings(host=None, port=None, data_dir=None, config_file=None, no_auth=None)
    assert (s.host, s.port, s.no_auth) == ("127.0.0.1", 30000, False)
    assert s.data_dir == home / ".clawback"


def test_toml_in_default_data_dir(home: Path) -> None:
    write_toml(home / ".clawback" / "clawback.toml", 'port = 31001\nhost = "0.0.0.0"\n')
    s = load_settings()
    assert (s.port, s.host) == (31001, "0.0.0.0")


def test_toml_in_data_dir_given_by_flag(home: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    write_toml(data / "clawback.toml", "port = 31002\nsession_idle_timeout_s = 5\n")
    s = load_settings(data_dir=str(data))
    assert s.data_dir == data
    assert (s.port, s.session_idle_timeout_s) == (31002, 5.0)


def test_toml_in_data_dir_given_by_env(home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = tmp_path / "envdata"
    write_toml(data / "clawback.toml", "port = 31003\n")
    monkeypatch.setenv("CLAWBACK_DATA_DIR", str(data))
    s = load_settings()
    assert (s.data_dir, s.port) == (data, 31003)


def test_toml_in_cwd(home: Path) -> None:
    write_toml(Path.cwd() / "clawback.toml", 'model = "/models/qwen"\n')
    assert load_settings().model == "/models/qwen"


def test_toml_in_data_dir_wins_over_cwd(home: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    write_toml(data / "clawback.toml", "port = 31004\n")
    write_toml(Path.cwd() / "clawback.toml", 'port = 39999\nhost = "10.0.0.1"\n')
    s = load_settings(data_dir=str(data))
    assert (s.port, s.host) == (31004, "127.0.0.1")  # only one file is read


def test_explicit_config_file_wins_over_found_ones(home: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    write_toml(data / "clawback.toml", "port = 31005\n")
    write_toml(Path.cwd() / "clawback.toml", "port = 31006\n")
    explicit = write_toml(tmp_path / "elsewhere" / "my.toml", 'port = 31007\nlog_level = "debug"\n')
    s = load_settings(data_dir=str(data), config_file=str(explicit))
    assert (s.port, s.log_level) == (31007, "debug")
    assert s.config_file == explicit


def test_explicit_config_file_from_env(home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    explicit = write_toml(tmp_path / "env.toml", "port = 31008\n")
    monkeypatch.setenv("CLAWBACK_CONFIG_FILE", str(explicit))
    assert load_settings().port == 31008
    # A --config flag beats the env var.
    flag = write_toml(tmp_path / "flag.toml", "port = 31009\n")
    assert load_settings(config_file=str(flag)).port == 31009


def test_relative_and_home_config_paths(home: Path) -> None:
    write_toml(Path.cwd() / "conf" / "rel.toml", "port = 31010\n")
    assert load_settings(config_file="conf/rel.toml").port == 31010
    write_toml(home / "cb.toml", "port = 31011\n")
    assert load_settings(config_file="~/cb.toml").port == 31011


def test_precedence_chain(home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = tmp_path / "data"
    write_toml(data / "clawback.toml",
               'port = 31000\nhost = "0.0.0.0"\nmodel = "toml-model"\nlog_level = "warning"\n')
    monkeypatch.setenv("CLAWBACK_DATA_DIR", str(data))
    s = load_settings()
    assert (s.port, s.host, s.model, s.log_level) == (31000, "0.0.0.0", "toml-model", "warning")

    monkeypatch.setenv("CLAWBACK_PORT", "32000")
    monkeypatch.setenv("CLAWBACK_MODEL", "env-model")
    s = load_settings()
    assert (s.port, s.host, s.model, s.log_level) == (32000, "0.0.0.0", "env-model", "warning")

    s = load_settings(port=33000, log_level="error", model=None)
    assert (s.port, s.host, s.model, s.log_level) == (33000, "0.0.0.0", "env-model", "error")
    assert s.data_dir == data


def test_env_values_are_parsed(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLAWBACK_NO_AUTH", "true")
    monkeypatch.setenv("CLAWBACK_SESSION_IDLE_TIMEOUT_S", "2.5")
    monkeypatch.setenv("CLAWBACK_API_KEY", "sk-secret")
    s = load_settings()
    assert s.no_auth is True and s.session_idle_timeout_s == 2.5
    assert s.api_key is not None and s.api_key.get_secret_value() == "sk-secret"
    assert "sk-secret" not in repr(s)


def test_data_dir_flag_beats_env_for_finding_the_toml(home: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    write_toml(tmp_path / "envdir" / "clawback.toml", "port = 31012\n")
    write_toml(tmp_path / "flagdir" / "clawback.toml", "port = 31013\n")
    monkeypatch.setenv("CLAWBACK_DATA_DIR", str(tmp_path / "envdir"))
    s = load_settings(data_dir=str(tmp_path / "flagdir"))
    assert (s.data_dir, s.port) == (tmp_path / "flagdir", 31013)


def test_missing_explicit_config_file_raises(home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(FileNotFoundError, match="nope.toml"):
        load_settings(config_file=str(tmp_path / "nope.toml"))
    (tmp_path / "a-dir.toml").mkdir()
    with pytest.raises(FileNotFoundError):
        load_settings(config_file=str(tmp_path / "a-dir.toml"))
    monkeypatch.setenv("CLAWBACK_CONFIG_FILE", str(tmp_path / "missing-env.toml"))
    with pytest.raises(FileNotFoundError, match="missing-env.toml"):
        load_settings()


def test_settings_are_frozen(home: Path) -> None:
    s = load_settings()
    with pytest.raises(ValidationError):
        s.port = 1  # type: ignore[misc]
    with pytest.raises(ValidationError):
        s.data_dir = Path("/elsewhere")  # type: ignore[misc]
    assert s.port == 30000


def test_unknown_toml_keys_are_rejected(home: Path) -> None:
    write_toml(Path.cwd() / "clawback.toml", "port = 31014\nprot = 1\n")
    with pytest.raises(ValidationError, match="prot"):
        load_settings()


def test_unknown_flags_are_rejected(home: Path) -> None:
    with pytest.raises(ValidationError, match="bogus"):
        load_settings(bogus=1)


@pytest.mark.parametrize("toml,bad", [
    ("port = 70000\n", "port"),
    ('engine = "tgi"\n', "engine"),
    ('engine_url = "127.0.0.1:30001"\n', "engine_url"),
    ('dtype = "int8"\n', "dtype"),
    ("session_cache_size = 0\n", "session_cache_size"),
    ('port = "not a number"\n', "port"),
])
def test_invalid_toml_values_are_rejected(home: Path, toml: str, bad: str) -> None:
    write_toml(Path.cwd() / "clawback.toml", toml)
    with pytest.raises(ValidationError, match=bad):
        load_settings()


def test_invalid_env_value_is_rejected(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLAWBACK_PORT", "abc")
    with pytest.raises(ValidationError, match="port"):
        load_settings()


def test_data_dir_tilde_is_expanded_from_every_source(home: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_settings(data_dir="~/flag-dir").data_dir == home / "flag-dir"

    write_toml(home / "env-dir" / "clawback.toml", "port = 31015\n")
    monkeypatch.setenv("CLAWBACK_DATA_DIR", "~/env-dir")
    s = load_settings()
    assert s.data_dir == home / "env-dir" and s.port == 31015  # its toml is found too
    assert s.db_path == home / "env-dir" / "clawback.db"
    monkeypatch.delenv("CLAWBACK_DATA_DIR")

    write_toml(Path.cwd() / "clawback.toml", 'data_dir = "~/toml-dir"\n')
    assert load_settings().data_dir == home / "toml-dir"
    assert isinstance(Settings(data_dir="~").data_dir, Path) and Settings(data_dir="~").data_dir == home


def test_train_and_judge_tables_with_a_preset_and_overrides(home: Path) -> None:
    write_toml(Path.cwd() / "clawback.toml", '[train]\npreset = "seed"\ntis_cap = 1.5\nkl_coef = 0.02\n'
                                             'weight_decay = 0.05\n\n[judge]\nbackend = "off"\nvotes = 5\n')
    s = load_settings()
    tc = s.train_config()
    assert (tc.method, tc.lr, tc.betas, tc.tis_cap, tc.kl_coef, tc.weight_decay) == (
        "combined", 1e-5, (0.9, 0.98), 1.5, 0.02, 0.05)  # the seed recipe, three knobs overridden
    sig = s.signal_config()
    assert (sig.teacher, sig.judge_context, sig.count_zero_signal, sig.judge_votes) == ("base", "response_only", True, 5)
    assert s.judge.backend == "off"
    assert load_settings(config_file=str(write_toml(home / "plain.toml", ""))).signal_config().teacher == "self"


def test_train_and_judge_tables_from_the_environment(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_toml(Path.cwd() / "clawback.toml", '[train]\npreset = "seed"\nlr = 3e-4\n')
    monkeypatch.setenv("CLAWBACK_TRAIN__BATCH_SIZE", "2")
    monkeypatch.setenv("CLAWBACK_TRAIN__ENABLED", "false")
    monkeypatch.setenv("CLAWBACK_JUDGE__BACKEND", "off")
    s = load_settings()
    assert (s.train.preset, s.train.lr, s.train.batch_size, s.train.enabled) == ("seed", 3e-4, 2, False)
    assert s.train.betas == (0.9, 0.98) and s.judge.backend == "off"  # the rest of the seed recipe stands
    monkeypatch.setenv("CLAWBACK_TRAIN", '{"lora_rank": 8}')  # a whole table as JSON, below its own variables
    assert (load_settings().train.lora_rank, load_settings().train.batch_size) == (8, 2)


@pytest.mark.parametrize("toml,new", [
    ('method = "binary"\n', r"\[train\] method in clawback.toml, or CLAWBACK_TRAIN__METHOD"),
    ("train = false\n", r"\[train\] enabled in clawback.toml, or CLAWBACK_TRAIN__ENABLED"),
    ('judge = "off"\n', r"\[judge\] backend in clawback.toml, or CLAWBACK_JUDGE__BACKEND"),
    ("trainer_threads = 2\n", r"\[train\] threads"),
    ('judge_url = "http://h/v1"\n', r"\[judge\] url"),
])
def test_flat_keys_of_earlier_versions_are_refused_naming_their_place(home: Path, toml: str, new: str) -> None:
    write_toml(Path.cwd() / "clawback.toml", toml)
    with pytest.raises(ValidationError, match=f"is no longer read .* give {new}"):
        load_settings()


@pytest.mark.parametrize("name,value,new", [
    ("CLAWBACK_BATCH_SIZE", "2", "CLAWBACK_TRAIN__BATCH_SIZE"),
    ("CLAWBACK_TRAIN", "false", "CLAWBACK_TRAIN__ENABLED"),
    ("CLAWBACK_JUDGE", "off", "CLAWBACK_JUDGE__BACKEND"),
    ("clawback_method", "binary", "CLAWBACK_TRAIN__METHOD"),
])
def test_flat_env_vars_of_earlier_versions_are_refused(home: Path, monkeypatch: pytest.MonkeyPatch, name: str,
                                                       value: str, new: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"{name.upper()} is no longer read.*{new} in the environment"):
        load_settings()
    with pytest.raises(ValueError, match="no longer read"):
        Settings()


def test_flat_keys_as_arguments_are_refused(home: Path) -> None:
    with pytest.raises(ValidationError, match=r"lr is no longer read .* \[train\] lr"):
        load_settings(lr=3e-4)


def test_unknown_or_bad_train_and_judge_settings_are_errors(home: Path) -> None:
    with pytest.raises(ValidationError, match="train.tis_capp"):
        load_settings(config_file=str(write_toml(home / "typo.toml", "[train]\ntis_capp = 2.0\n")))
    with pytest.raises(ValidationError, match="tis_cap must be >= 1"):
        load_settings(config_file=str(write_toml(home / "bad.toml", "[train]\ntis_cap = 0.5\n")))
    with pytest.raises(ValidationError, match="train.lr"):
        load_settings(config_file=str(write_toml(home / "type.toml", '[train]\nlr = "fast"\n')))
    with pytest.raises(ValidationError, match="votes must be odd"):
        load_settings(config_file=str(write_toml(home / "even.toml", "[judge]\nvotes = 4\n")))


def test_train_settings_are_the_train_config_with_the_daemons_own_fields(home: Path) -> None:
    s = load_settings()
    assert s.train_config() == TrainConfig() and type(s.train_config()) is TrainConfig
    assert TrainSettings(preset="seed").config() == PRESETS["seed"]
    assert TrainSettings(preset="seed", lr=1.0).config() == dataclasses.replace(PRESETS["seed"], lr=1.0)


def test_engines_get_their_settings_and_the_trained_lora_as_an_engine_config(home: Path) -> None:
    s = Settings(data_dir=home / "d", engine="vllm", engine_url="http://h:1", engine_api_key="k", engine_port=5,
                 train={"lora_rank": 8})
    c = s.engine_config()
    assert (c.kind, c.url, c.api_key, c.port, c.log_dir, c.lora_rank) == ("vllm", "http://h:1", "k", 5,
                                                                           home / "d" / "logs", 8)
    assert c.lora_target_modules == s.train_config().target_modules
