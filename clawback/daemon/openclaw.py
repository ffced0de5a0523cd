"""`clawback openclaw install | uninstall | doctor`: connect an OpenClaw to this daemon and back.

Everything goes through the OpenClaw CLI (`plugins install --link`, `config patch`, `config
validate`, `plugins inspect`, `gateway health`, `agent`), so OpenClaw validates its own config.
Install keeps the config file's bytes from before the first install in
`<data_dir>/openclaw/`; uninstall unlinks the plugin and writes those bytes back.
"""

from __future__ import annotations

import functools
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import httpx

from clawback.records import JsonObject

from .openclaw_config import AgentDefaults, ConfigPatch, PluginConfig, Provider

PLUGIN_ID = "clawback"
EXTENSION_DIR = Path(__file__).resolve().parents[2] / "extension"  # a checkout's plugin (link mode)
SLIM_CONTEXT = 16384  # a default OpenClaw main request is about 13 K tokens
CHECK_SESSION = "agent:main:clawback-install-check"  # the plugin caps this session's replies (extension/src/tagging.ts)
CHECK_MESSAGE = "Say hello in five words."
RECENT_MAIN_S = 24 * 3600
REDACTED = "__OPENCLAW_REDACTED__"  # what `openclaw config get` shows for a secret


class SetupError(RuntimeError):
    pass


def say(msg: str) -> None:
    print(f"[clawback] {msg}", flush=True)


class OpenClawCli:
    def __init__(self, command: str) -> None:
        self.argv = shlex.split(command)

    def missing(self) -> SetupError:
        return SetupError(f"the OpenClaw CLI ({shlex.join(self.argv)}) is not installed: install it with Node >= 24.16 "
                          "(npm i -g openclaw@2026.9.6; an unpinned `npm i -g openclaw` on an older Node installs "
                          "0.0.1, an empty placeholder) or pass --openclaw \"node /path/to/openclaw.mjs\"")

    def start(self, *args: str) -> subprocess.Popen:
        try:
            return subprocess.Popen([*self.argv, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    env={**os.environ, "NO_COLOR": "1"})
        except FileNotFoundError:
            raise self.missing() from None

    def run(self, *args: str, stdin: str | None = None, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
        try:
            proc = subprocess.run([*self.argv, *args], input=stdin, capture_output=True, text=True, timeout=timeout,
                                  env={**os.environ, "NO_COLOR": "1"})
        except FileNotFoundError:
            raise self.missing() from None
        if check and proc.returncode != 0:
            raise SetupError(f"`openclaw {shlex.join(args)}` failed (exit {proc.returncode}):\n{(proc.stderr or proc.stdout)[-2000:]}")
        return proc

    def json(self, *args: str) -> JsonObject:
        """The JSON document a `--json` command printed (OpenClaw may print a banner first)."""
        out = self.run(*args, "--json").stdout
        start = min((i for i in (out.find("{"), out.find("[")) if i >= 0), default=-1)
        if start < 0:
            raise SetupError(f"`openclaw {' '.join(args)} --json` printed no JSON: {out[-500:]}")
        return json.JSONDecoder().raw_decode(out[start:])[0]

    @functools.cached_property
    def config_file(self) -> Path:
        return Path(self.run("config", "file").stdout.strip().splitlines()[-1])


@dataclass
class Daemon:
    url: str  # without /v1
    key: str | None

    def get(self, path: str) -> JsonObject:
        headers = {"authorization": f"Bearer {self.key}"} if self.key else {}
        r = httpx.get(f"{self.url}{path}", headers=headers, timeout=30)
        r.raise_for_status()
        return r.json()


def _flatten(value: object, prefix: str = "") -> dict[str, object]:
    if isinstance(value, dict) and (value or not prefix):
        out: dict[str, object] = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else k))
        return out
    return {prefix: value}


def config_changes(before: Mapping[str, object], after: Mapping[str, object], secret: str | None) -> list[str]:
    """What changed between two configs, one line per leaf path; the API key is never printed."""
    old, new = _flatten(before), _flatten(after)

    def show(v: object) -> str:
        text = json.dumps(v, ensure_ascii=False)
        return text.replace(secret, "<api key>") if secret else text

    lines = [f"  + {k} = {show(new[k])}" for k in new if k not in old]
    lines += [f"  ~ {k}: {show(old[k])} -> {show(new[k])}" for k in new if k in old and old[k] != new[k]]
    lines += [f"  - {k}" for k in old if k not in new]
    return lines


def _read_json(path: Path) -> JsonObject:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return {}  # JSON5 with comments: the change list is then shown from the patch only


def provider_patch(daemon: Daemon, model: str, context: int, key_file: Path | None, max_tokens: int,
                   make_default: bool, slim: bool) -> ConfigPatch:
    provider: Provider = {
        "baseUrl": daemon.url + "/v1", "api": "openai-completions", "apiKey": daemon.key or "no-auth",
        "models": [{"id": model, "name": f"clawback {model}", "reasoning": False, "input": ["text"],
                    "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0},
                    "contextWindow": context, "maxTokens": max_tokens or min(4096, max(256, context // 8))}],
    }
    plugin_config: PluginConfig = {"daemonUrl": daemon.url}
    if key_file is not None:
        plugin_config["apiKeyFile"] = str(key_file)
    patch: ConfigPatch = {
        "plugins": {"entries": {PLUGIN_ID: {"enabled": True, "hooks": {"allowConversationAccess": True},
                                            "config": plugin_config}}},
        "models": {"providers": {PLUGIN_ID: provider}},
    }
    defaults: AgentDefaults = {}
    if make_default:
        defaults["model"] = {"primary": f"{PLUGIN_ID}/{model}"}
    if slim:
        defaults.update(skills=[], bootstrapMaxChars=500, bootstrapTotalMaxChars=1000)
        patch["tools"] = {"deny": ["*"]}
    if defaults:
        patch["agents"] = {"defaults": defaults}
    return patch


def _ask(question: str, default: bool, assume: bool) -> bool:
    """The person's answer; with --yes, or without a terminal to ask on, the default, said."""
    if assume or not sys.stdin.isatty():
        say(f"{question} {'yes' if default else 'no'} (the default answer: "
            f"{'--yes' if assume else 'no terminal to ask on'})")
        return default
    answer = input(f"[clawback] {question} [{'Y/n' if default else 'y/N'}] ").strip().lower()
    return default if not answer else answer.startswith("y")


def _backup_dir(data_dir: Path) -> Path:
    return data_dir / "openclaw"


def install(oc: OpenClawCli, daemon: Daemon, data_dir: Path, key_file: Path | None,
            offline_model: Callable[[], JsonObject], *, plugin: str | None,
            make_default: bool | None, slim: bool | None, max_tokens: int, restart: bool, verify: bool,
            assume_yes: bool) -> int:
    timings: dict[str, float] = {}
    t = time.time()

    def done(step: str) -> None:
        nonlocal t
        timings[step] = round(time.time() - t, 1)
        t = time.time()

    say(f"step 1/6: OpenClaw CLI: {oc.run('--version').stdout.strip().splitlines()[-1]}")
    try:
        model = daemon.get("/v1/models")["data"][0]
        say(f"step 2/6: daemon {daemon.url}: model {model['id']}, context {model.get('context_length')} tokens")
    except httpx.HTTPError as e:
        model = offline_model()
        verify = False
        say(f"step 2/6: the daemon at {daemon.url} is not running ({type(e).__name__}): configuring for model "
            f"{model['id']} ({model['context_length']} tokens) from the settings; no test turn. Once it runs: "
            "clawback openclaw doctor --test-turn")
    context = int(model.get("context_length") or 8192)
    done("check")

    config = oc.config_file
    backup = _backup_dir(data_dir)
    manifest_path = backup / "install.json"
    if manifest_path.is_file():
        say(f"step 3/6: keeping the backup of the first install ({backup / 'openclaw.json.before'})")
    else:
        backup.mkdir(parents=True, exist_ok=True)
        existed = config.is_file()
        if existed:
            shutil.copyfile(config, backup / "openclaw.json.before")
        manifest_path.write_text(json.dumps({"config": str(config), "existed": existed, "at": time.time()}))
        say(f"step 3/6: backed up {config} to {backup / 'openclaw.json.before'}" if existed else
            f"step 3/6: {config} does not exist yet; uninstall will remove it")
    before = _read_json(config)

    source = plugin or str(EXTENSION_DIR)
    link = plugin is None
    if link and not (EXTENSION_DIR / "openclaw.plugin.json").is_file():
        raise SetupError(f"no plugin checkout at {EXTENSION_DIR}: pass --plugin clawhub:clawback (the published package)")
    args = ["plugins", "install", *(["--link"] if link else []), source, "--force", "--accept-capabilities"]
    say(f"step 4/6: openclaw {' '.join(args)}")
    oc.run(*args)
    done("plugin")

    if make_default is None:  # an agent that does not use the model never teaches it anything
        make_default = _ask(f"make clawback/{model['id']} the default model of your agents (--make-default)?", True,
                            assume_yes)
    if slim is None:
        slim = False
        if context < SLIM_CONTEXT:
            say(f"  this model has {context} tokens of context; a default OpenClaw main request is about 13 K.")
            say("  the slim profile turns off all skills (agents.defaults.skills: []) and tools (tools.deny: [\"*\"])")
            say("  and trims workspace bootstrap files to 500 characters each, 1000 in total.")
            slim = _ask("apply the slim profile (--slim)?", True, assume_yes)
    patch = provider_patch(daemon, model["id"], context, key_file, max_tokens, make_default, slim)
    say("step 5/6: openclaw config patch --stdin; openclaw config validate")
    oc.run("config", "patch", "--stdin", stdin=json.dumps(patch))
    oc.run("config", "validate")
    changes = config_changes(before, _read_json(config), daemon.key)
    say(f"changed in {config}:")
    print("\n".join(changes or [f"  (patch) {line}" for line in config_changes({}, patch, daemon.key)]), flush=True)
    done("config")

    if restart:
        proc = oc.run("gateway", "restart", check=False)
        if proc.returncode == 0:
            say("gateway restarted (openclaw gateway restart)")
        else:
            say("the gateway is not a service here: restart it yourself (stop `openclaw gateway run` and start it "
                "again, or `openclaw gateway restart` for the service) so that it loads the plugin")
    else:
        say("restart the gateway to load the plugin: openclaw gateway restart")
    if not verify:
        say(f"done (no test turn). Check the chain with `clawback openclaw doctor`. Steps: {timings}")
        return 0
    say(f"step 6/6: a test turn through OpenClaw (openclaw agent --session-key {CHECK_SESSION} --model clawback/...; "
        "the plugin caps its reply at a few tokens)")
    verify_turn(oc, daemon, progress=say)
    done("verify")
    say(f"done: the daemon saw the test turn as a tagged main call. Steps (s): {timings}")
    return 0


def verify_turn(oc: OpenClawCli, daemon: Daemon, timeout_s: float = 600, progress: Callable[[str], None] | None = None,
                progress_every_s: float = 10) -> None:
    """One agent turn through the gateway, on the clawback model whatever the agent's default; the
    daemon must have served it as a tagged main call. `progress` hears how it goes while it runs."""
    started = time.time()
    model = daemon.get("/v1/models")["data"][0]["id"]

    def tagged(status: JsonObject) -> bool:
        last = (status.get("main_calls") or {}).get("last_tagged_at")
        return last is not None and last >= started - 1

    proc = oc.start("agent", "--session-key", CHECK_SESSION, "--model", f"{PLUGIN_ID}/{model}",
                    "--message", CHECK_MESSAGE, "--json", "--timeout", str(int(timeout_s)))
    arrived, note_at = False, started + progress_every_s
    while True:
        try:
            out, err = proc.communicate(timeout=1)
            break
        except subprocess.TimeoutExpired:
            if time.time() - started > timeout_s + 60:
                proc.kill()
                out, err = proc.communicate()
                break
        if progress is not None and time.time() >= note_at:
            note_at += progress_every_s
            arrived = arrived or tagged(daemon.get("/v1/status"))
            progress(f"  test turn, {time.time() - started:.0f} s: " +
                     ("the daemon got the tagged call and is answering it" if arrived else
                      "waiting for the call to reach the daemon (OpenClaw prepares the agent's request)"))
    status = daemon.get("/v1/status")
    if tagged(status):
        return
    hint = ("the gateway did not answer: is it running with the new config? (openclaw gateway restart)"
            if proc.returncode != 0 else
            "the turn ran but no tagged main call reached the daemon: was the gateway restarted after install, "
            "so that it loaded the plugin?")
    untagged = (status.get("capture") or {}).get("untagged_calls", 0)
    raise SetupError(f"verification failed: {hint} (daemon: {untagged} untagged calls so far)\n"
                     f"{(err or out)[-1500:]}")


def _without(value: object, secret: str) -> object:
    """`value` with every string field equal to `secret` left out."""
    if isinstance(value, dict):
        return {k: _without(v, secret) for k, v in value.items() if v != secret}
    if isinstance(value, list):
        return [_without(v, secret) for v in value if v != secret]
    return value


SCAN_MAX_BYTES = 50 * 1024 * 1024  # larger files are not OpenClaw's configs or backups


def scrub_key(state_dir: Path, key: str) -> tuple[list[Path], list[Path]]:
    """Take the daemon's key out of the JSON files under OpenClaw's state dir that still hold it
    (its config backups `openclaw.json.bak*`, `.last-good`, generated model lists): each loses the
    fields whose value is the key and is rewritten in place. Returns the files scrubbed, and those
    that hold the key but are not JSON (logs, transcripts), which are left as they are."""
    needle = key.encode()
    scrubbed, remaining = [], []
    for path in sorted(state_dir.rglob("*")):
        if path.is_symlink() or not path.is_file() or "node_modules" in path.parts or path.stat().st_size > SCAN_MAX_BYTES:
            continue
        raw = path.read_bytes()
        if needle not in raw:
            continue
        try:
            doc = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError):
            remaining.append(path)
            continue
        tmp = path.with_name(path.name + f".clawback-{uuid.uuid4().hex[:8]}")
        tmp.write_text(json.dumps(_without(doc, key), indent=2, ensure_ascii=False) + "\n")
        tmp.chmod(path.stat().st_mode & 0o777)
        tmp.replace(path)
        scrubbed.append(path)
    return scrubbed, remaining


def uninstall(oc: OpenClawCli, data_dir: Path, key: str | None = None) -> int:
    """Unlink the plugin, put the config back, and take `key` (the daemon's) out of the copies
    OpenClaw made of its config meanwhile."""
    backup = _backup_dir(data_dir)
    manifest_path = backup / "install.json"
    if not manifest_path.is_file():
        raise SetupError(f"no install recorded in {backup}: nothing to undo")
    manifest = json.loads(manifest_path.read_text())
    config = Path(manifest["config"])
    proc = oc.run("plugins", "uninstall", PLUGIN_ID, "--force", check=False)
    say("openclaw plugins uninstall clawback --force: " + ("done" if proc.returncode == 0 else
                                                             f"exit {proc.returncode} (continuing)"))
    if manifest["existed"]:
        tmp = config.with_name(config.name + f".clawback-{uuid.uuid4().hex[:8]}")
        shutil.copyfile(backup / "openclaw.json.before", tmp)
        tmp.replace(config)  # atomic: the gateway never reads a half-written config
        say(f"restored {config} as it was before `clawback openclaw install`")
    else:
        config.unlink(missing_ok=True)
        say(f"removed {config} (it did not exist before the install)")
    shutil.rmtree(backup)
    if key is not None and config.is_file() and key.encode() in config.read_bytes():
        say(f"the daemon's API key stays in {config} and its backups: it was there before the install")
    elif key is not None:
        scrubbed, remaining = scrub_key(config.parent, key)
        if scrubbed:
            say(f"removed the daemon's API key from {len(scrubbed)} file(s) OpenClaw keeps in {config.parent}: "
                + ", ".join(str(p.relative_to(config.parent)) for p in scrubbed))
        for path in remaining:
            say(f"the daemon's API key remains in {path}: it is not a JSON file, so it was left as it is; "
                "delete the file, or the lines that hold the key, if you no longer need it")
    say("restart the gateway (openclaw gateway restart) so that it unloads the plugin")
    return 0


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""


def doctor(oc: OpenClawCli, daemon: Daemon, *, test_turn: bool = False, now: Callable[[], float] = time.time) -> list[Check]:
    checks: list[Check] = []
    if test_turn:
        try:
            verify_turn(oc, daemon, progress=say)
            checks.append(Check("test turn", True, "an agent turn through OpenClaw arrived as a tagged main call"))
        except (SetupError, httpx.HTTPError) as e:
            checks.append(Check("test turn", False, str(e).splitlines()[0][:300], "see the checks below"))

    def check(name: str, fn: Callable[[], tuple[bool, str, str]]) -> None:
        try:
            ok, detail, fix = fn()
        except (SetupError, httpx.HTTPError, KeyError, ValueError) as e:
            ok, detail, fix = False, str(e).splitlines()[0][:300], ""
        checks.append(Check(name, ok, detail, fix))

    status: JsonObject = {}

    def daemon_up() -> tuple[bool, str, str]:
        status.update(daemon.get("/v1/status"))
        return True, f"{daemon.url}: model {status['model']}, adapter {status['adapter_version'] or 'base'}", ""

    check("daemon", daemon_up)
    if not status:
        checks[-1].fix = "start the daemon: clawback serve"

    def gateway() -> tuple[bool, str, str]:
        proc = oc.run("gateway", "health", "--json", check=False, timeout=120)
        ok = proc.returncode == 0
        return ok, "reachable" if ok else (proc.stdout + proc.stderr).strip().splitlines()[-1][:200], \
            "start the gateway: openclaw gateway start (service) or openclaw gateway run"

    check("gateway", gateway)

    def plugin() -> tuple[bool, str, str]:
        info = oc.json("plugins", "inspect", PLUGIN_ID)["plugin"]
        ok = info.get("status") == "loaded" and info.get("enabled")
        return bool(ok), f"version {info.get('version')}, {info.get('status')}, from {info.get('rootDir')}", \
            "clawback openclaw install (links the plugin and enables it)"

    check("plugin", plugin)

    def provider() -> tuple[bool, str, str]:
        # From the file: `config get` redacts the key. A JSON5 file falls back to it (key unchecked).
        p = _read_json(oc.config_file).get("models", {}).get("providers", {}).get(PLUGIN_ID) \
            or oc.json("config", "get", f"models.providers.{PLUGIN_ID}")
        base_ok = str(p.get("baseUrl", "")).rstrip("/") == daemon.url + "/v1"
        key_ok = daemon.key is None or p.get("apiKey") in (daemon.key, REDACTED)
        detail = f"baseUrl {p.get('baseUrl')}" + ("" if key_ok else ", API key differs from this daemon's")
        return base_ok and key_ok, detail, "clawback openclaw install (rewrites the provider for this daemon)"

    check("provider", provider)

    def main_calls() -> tuple[bool, str, str]:
        if not status:
            return False, "unknown: the daemon is not reachable", "start the daemon: clawback serve"
        last = (status.get("main_calls") or {}).get("last_tagged_at")
        untagged = (status.get("capture") or {}).get("untagged_calls", 0)
        if last is not None and now() - last < RECENT_MAIN_S:
            return True, f"last tagged main call {int(now() - last)} s ago", ""
        return False, f"no tagged main call in 24 h ({untagged} untagged calls)", \
            ("untagged calls arrive: the plugin is not tagging; restart the gateway" if untagged else
             "send a message to an agent whose model is clawback/<model>")

    check("tagged main calls", main_calls)

    def websocket() -> tuple[bool, str, str]:
        if not status:
            return False, "unknown: the daemon is not reachable", "start the daemon: clawback serve"
        n = int((status.get("signals") or {}).get("feedback_connections", 0))
        return n > 0, f"{n} feedback connection(s)", "restart the gateway so that the plugin connects (openclaw gateway restart)"

    check("feedback WebSocket", websocket)

    def outbox() -> tuple[bool, str, str]:
        files = list(oc.config_file.parent.rglob("outbox.jsonl"))
        pending = sum(1 for f in files for line in f.read_text().splitlines() if line.strip())
        return pending == 0, f"{pending} event(s) waiting in the plugin's outbox", \
            "the gateway cannot reach the daemon: check plugins.entries.clawback.config.daemonUrl and that the daemon runs"

    check("outbox", outbox)
    return checks


def print_checks(checks: list[Check]) -> int:
    for c in checks:
        print(f"{'ok ' if c.ok else 'FAIL'} {c.name}: {c.detail}" + ("" if c.ok or not c.fix else f"\n     fix: {c.fix}"))
    failed = [c.name for c in checks if not c.ok]
    print("all green" if not failed else f"{len(failed)} problem(s): {', '.join(failed)}")
    return 0 if not failed else 1
