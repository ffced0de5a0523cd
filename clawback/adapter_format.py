"""Adapter versions on disk: publish atomically, validate, resume, and move between nodes.

    <root>/v{N}/adapter_config.json        PEFT LoRA config   } loadable unchanged by
    <root>/v{N}/adapter_model.safetensors  LoRA weights       } PEFT, SGLang and vLLM
    <root>/v{N}/optimizer.pt               AdamW state, so training resumes after a restart
    <root>/v{N}/clawback.json              metadata + sha256 of every file above

A version is written into a hidden temp dir beside its target, fsynced, checked, and renamed to
`v{N}` in one step, so `v{N}` either exists complete or not at all. A crash leaves at most a
`.v{N}.*.tmp` dir, which nothing reads and `resume` deletes.

The trainer and the engine may run on different nodes with no shared filesystem: `read_files`
turns a version into bytes (they travel through Ray's object store) and `install` commits them
on the other side with the same atomic commit and checks as `publish`.

Trainer, daemon and engines all import this module: it is the one definition of what a version
is, including which modules its LoRA adapts (`lora_targets`), which servers that size their LoRA
buffers up front (SGLang) must know before the first version exists.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .records import JsonObject, Version

if TYPE_CHECKING:  # torch loads with the first function that needs it: TrainConfig imports ALL_LINEAR
    import torch
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

CONFIG, WEIGHTS, OPTIMIZER, META = "adapter_config.json", "adapter_model.safetensors", "optimizer.pt", "clawback.json"
FILES = (CONFIG, WEIGHTS, OPTIMIZER, META)  # a version is exactly these (PEFT's README.md is not needed)
# Every linear projection except the output head; resolved by `lora_targets` to short names.
ALL_LINEAR = "all-linear"


class AdapterError(Exception):
    """A version dir that must not be served or resumed from."""


def lora_targets(model: PreTrainedModel, targets: str | Sequence[str] = ALL_LINEAR) -> list[str] | str:
    """The modules a LoRA on `model` adapts: a list of short names (q_proj, ...), or a regex str.

    "all-linear" is resolved here to the short names of every nn.Linear but the output head:
    PEFT would save full module paths, which some SGLang releases do not map onto their fused
    qkv/gate_up layers."""
    import torch

    if not isinstance(targets, str):
        return sorted(targets)
    if targets != ALL_LINEAR:
        return targets
    head = model.get_output_embeddings()
    return sorted({name.rsplit(".", 1)[-1] for name, mod in model.named_modules()
                   if isinstance(mod, torch.nn.Linear) and mod is not head})


def lora_target_modules(model_dir: str | Path, targets: str | Sequence[str] = ALL_LINEAR) -> list[str]:
    """`lora_targets` for a model on disk, without loading its weights (built on the meta device)."""
    if targets != ALL_LINEAR:
        return [targets] if isinstance(targets, str) else sorted(targets)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return list(lora_targets(model, targets))


def version_dir(root: str | Path, version: int) -> Path:
    return Path(root) / Version(version).name


def list_versions(root: str | Path) -> list[int]:
    """Committed versions, ascending (temp dirs and anything else are ignored)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(v for p in root.iterdir() if p.is_dir() and (v := Version.match(p.name)) is not None)


def publish(
    root: str | Path, version: int, model: Any, optimizer: torch.optim.Optimizer, meta: Mapping[str, object]
) -> Path:  # Any: a PEFT model, which peft types as a union of model kinds
    """Write `model`'s adapter, the optimizer state and `meta` as `<root>/v{version}` atomically.

    `meta` is the caller's record (parent, samples used, method, loss, reward stats, timings...);
    version, creation time and file hashes are added here. Returns the committed dir.
    """

    import torch

    def write(tmp: Path) -> None:
        model.save_pretrained(str(tmp))
        torch.save(optimizer.state_dict(), tmp / OPTIMIZER)
        files = {name: _sha256(tmp / name) for name in (CONFIG, WEIGHTS, OPTIMIZER)}
        info = {**meta, "version": int(version), "created_at": time.time(), "files": files}
        (tmp / META).write_text(json.dumps(info, indent=2, sort_keys=True, default=str))

    return _commit(root, version, write)


def read_files(path: str | Path) -> dict[str, bytes]:
    """A valid version's files as bytes, to send to another process or node (Ray's object store)."""
    path = Path(path)
    validate(path)
    return {name: (path / name).read_bytes() for name in FILES}


def install(root: str | Path, version: int, files: dict[str, bytes]) -> Path:
    """Commit a version received as bytes (from `read_files` elsewhere) as `<root>/v{version}`.

    The same atomic commit as `publish`: the files are checked against their recorded hashes
    before the rename, so a damaged transfer never becomes a version.
    """
    if set(files) != set(FILES):  # also keeps names like '../x' out of the path
        raise AdapterError(f"{Version(version).name}: expected files {sorted(FILES)}, got {sorted(files)}")

    def write(tmp: Path) -> None:
        for name, data in files.items():
            (tmp / name).write_bytes(data)

    return _commit(root, version, write)


def _commit(root: str | Path, version: int, write: Callable[[Path], None]) -> Path:
    """Run `write(tmp)` in a hidden temp dir beside `<root>/v{version}`, check, fsync, rename."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = version_dir(root, version)
    if final.exists():
        raise AdapterError(f"{final} already exists")
    tmp = Path(tempfile.mkdtemp(prefix=f".{Version(version).name}.", suffix=".tmp", dir=root))
    try:
        write(tmp)
        _check(tmp, version)  # never commit what a loader would refuse (e.g. NaN weights)
        for f in tmp.iterdir():
            f.chmod(0o600)  # weights, optimizer state and manifest are the person's: private, in a 0700 dir
            _fsync(f)
        _fsync(tmp)
        tmp.rename(final)  # atomic on POSIX, same filesystem by construction
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync(root)  # make the rename itself durable
    return final


def validate(path: str | Path) -> JsonObject:
    """Return the version's metadata, or raise AdapterError if it must not be used."""
    path = Path(path)
    version = Version.match(path.name)
    if version is None or not path.is_dir():
        raise AdapterError(f"{path} is not a version dir (v{{N}})")
    return _check(path, version)


def resume(model: Any, optimizer: torch.optim.Optimizer, root: str | Path, version: int | None = None) -> JsonObject | None:
    """Load a version's adapter weights and optimizer state into `model` and `optimizer`.

    Both must be built from the same TrainConfig as the version (make_lora_model, make_optimizer).
    Without `version`, the newest version that validates is used (invalid ones are skipped with a
    warning). Returns its metadata, or None when there is nothing to resume from. Leftover temp
    dirs of interrupted publishes are deleted.
    """
    import torch
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file

    root = Path(root)
    for p in root.glob(".v*.tmp"):
        shutil.rmtree(p, ignore_errors=True)
    candidates = [version] if version is not None else list_versions(root)[::-1]
    for v in candidates:
        path = version_dir(root, v)
        try:
            info = validate(path)
        except AdapterError as e:
            if version is not None:
                raise
            log.warning("not resuming from %s: %s", path, e)
            continue
        device = next(p for p in model.parameters() if p.requires_grad).device
        saved = load_file(str(path / WEIGHTS), device=str(device))
        want = {k: tuple(t.shape) for k, t in get_peft_model_state_dict(model).items()}
        alpha = json.loads((path / CONFIG).read_text()).get("lora_alpha")
        if {k: tuple(t.shape) for k, t in saved.items()} != want or alpha != model.peft_config["default"].lora_alpha:
            raise AdapterError(f"{path} has a different LoRA signature (rank, alpha or target modules) than the model")
        set_peft_model_state_dict(model, saved)
        optimizer.load_state_dict(torch.load(path / OPTIMIZER, map_location=device, weights_only=True))
        return info
    return None


def _check(path: Path, version: int) -> JsonObject:
    import torch
    from safetensors.torch import load_file

    for name in FILES:
        if not (path / name).is_file():
            raise AdapterError(f"{path}: missing {name}")
    try:
        info = json.loads((path / META).read_text())
        config = json.loads((path / CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise AdapterError(f"{path}: unreadable metadata: {e}") from e
    if info.get("version") != version:
        raise AdapterError(f"{path}: metadata says version {info.get('version')!r}, expected {version}")
    if config.get("peft_type") != "LORA" or config.get("use_dora") or config.get("use_rslora"):
        raise AdapterError(f"{path}: not a plain LoRA adapter")
    for name in (CONFIG, WEIGHTS, OPTIMIZER):  # catches truncation and bit rot, not just bad headers
        if _sha256(path / name) != info.get("files", {}).get(name):
            raise AdapterError(f"{path}: {name} does not match its recorded sha256")
    try:
        tensors = load_file(str(path / WEIGHTS))
    except Exception as e:
        raise AdapterError(f"{path}: unreadable weights: {e}") from e
    if not tensors:
        raise AdapterError(f"{path}: no weights")
    bad = [k for k, t in tensors.items() if not torch.isfinite(t).all()]
    if bad:
        raise AdapterError(f"{path}: non-finite values in {bad[:3]}")
    return info


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
