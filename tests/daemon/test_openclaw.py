"""`clawback openclaw` pieces that need no OpenClaw: uninstall taking the daemon's key out of the
copies OpenClaw keeps of its config, the change list, and what `--yes` answers. The OpenClaw CLI is
`true` here (uninstall only asks it to unlink the plugin); the real OpenClaw runs in
extension/scripts/e2e.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from clawback.daemon.openclaw import OpenClawCli, _ask, config_changes, uninstall

KEY = "cb-0123456789abcdef"
BEFORE = {"gateway": {"port": 18789}}
INSTALLED = {**BEFORE, "models": {"providers": {"clawback": {"baseUrl": "http://127.0.0.1:30100/v1", "apiKey": KEY}}}}


def installed_openclaw(tmp_path: Path, before: dict) -> tuple[Path, Path, bytes]:
    """An OpenClaw dir as `clawback openclaw install` leaves it, with the backups OpenClaw made
    meanwhile; the data dir holding install's own backup."""
    oc = tmp_path / ".openclaw"
    oc.mkdir()
    config = oc / "openclaw.json"
    original = (json.dumps(before, indent=2) + "\n").encode()
    config.write_bytes(original)
    data = tmp_path / "data"
    (data / "openclaw").mkdir(parents=True)
    shutil.copyfile(config, data / "openclaw" / "openclaw.json.before")
    (data / "openclaw" / "install.json").write_text(json.dumps({"config": str(config), "existed": True, "at": 0}))
    config.write_text(json.dumps(INSTALLED))
    for name in ("openclaw.json.bak", "openclaw.json.bak.1", "openclaw.json.last-good"):
        (oc / name).write_text(json.dumps(INSTALLED, indent=2))
    (oc / "agents" / "main" / "agent").mkdir(parents=True)
    (oc / "agents" / "main" / "agent" / "models.json").write_text(json.dumps({"providers": INSTALLED["models"]["providers"]}))
    (oc / "logs").mkdir()
    (oc / "logs" / "gateway.log").write_text(f"provider clawback apiKey={KEY}\n")
    return oc, data, original


def holding_the_key(oc: Path) -> list[Path]:
    return sorted(p for p in oc.rglob("*") if p.is_file() and KEY.encode() in p.read_bytes())


def test_uninstall_takes_the_key_out_of_openclaws_backups(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    oc, data, original = installed_openclaw(tmp_path, BEFORE)
    assert uninstall(OpenClawCli("true"), data, KEY) == 0
    said = capsys.readouterr().out
    assert (oc / "openclaw.json").read_bytes() == original
    # Only the log, which is not JSON, still holds it, and install says exactly where and why.
    assert holding_the_key(oc) == [oc / "logs" / "gateway.log"]
    assert f"the daemon's API key remains in {oc / 'logs' / 'gateway.log'}: it is not a JSON file" in said
    assert "from 4 file(s)" in said and "openclaw.json.last-good" in said
    bak = json.loads((oc / "openclaw.json.bak").read_text())
    assert bak["models"]["providers"]["clawback"] == {"baseUrl": "http://127.0.0.1:30100/v1"}  # only the key went
    assert not (data / "openclaw").exists()


def test_a_key_that_was_there_before_the_install_stays(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    oc, data, original = installed_openclaw(tmp_path, INSTALLED)  # no-plugin mode, set up by hand earlier
    assert uninstall(OpenClawCli("true"), data, KEY) == 0
    assert (oc / "openclaw.json").read_bytes() == original
    assert oc / "openclaw.json.bak" in holding_the_key(oc)
    assert "it was there before the install" in capsys.readouterr().out


def test_change_list_of_a_config_that_did_not_exist_has_no_empty_line():
    assert config_changes({}, {"a": {"b": 1}}, None) == ["  + a.b = 1"]
    assert config_changes({"a": 1}, {"a": 2, "k": KEY}, KEY) == ['  + k = "<api key>"', "  ~ a: 1 -> 2"]


def test_yes_takes_the_default_and_says_so(capsys: pytest.CaptureFixture[str]):
    assert _ask("make clawback/clawback the default model of your agents (--make-default)?", True, True) is True
    assert capsys.readouterr().out == ("[clawback] make clawback/clawback the default model of your agents "
                                       "(--make-default)? yes (the default answer: --yes)\n")
