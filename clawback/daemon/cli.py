"""The daemon's commands: init, serve, status, adapters, dashboard, export.

`clawback.cli` adds `simulate` (from `clawback.sim`) and is the installed `clawback` command;
`python -m clawback.daemon.cli` runs the daemon's commands alone."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from clawback.records import JsonObject, Version

from . import display
from .config import Settings, load_settings

Subcommands = argparse._SubParsersAction  # what a command's parser is added to


def _settings_flags(p: argparse.ArgumentParser) -> None:
    # Every flag defaults to None so that only flags actually given override toml/env values.
    p.add_argument("--config", dest="config_file", help="path to clawback.toml")
    p.add_argument("--data-dir", help="data dir (default ~/.clawback)")
    p.add_argument("--host", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 30000)")
    p.add_argument("--model", help="a catalogue name (clawback models list; default qwen2.5-coder-0.5b-instruct), "
                                   "a .gguf file, a local HF model dir, or a hub id")
    p.add_argument("--served-model-name", help="model id clients ask for (default 'clawback')")
    p.add_argument("--engine", choices=["embedded", "vllm", "sglang"], help="inference engine (default embedded)")
    p.add_argument("--engine-url", help="attach to a running vLLM/SGLang server instead of launching one")
    p.add_argument("--device", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--no-auth", action="store_const", const=True, help="serve without a bearer key (local experiments)")
    p.add_argument("--ray-address", help="join this Ray cluster for the trainer (default: a local Ray runtime)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])


def _json_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the daemon's JSON (for scripts) instead of text")


def _settings(args: argparse.Namespace) -> Settings:
    keys = ("config_file", "data_dir", "host", "port", "model", "served_model_name", "engine", "engine_url", "device", "dtype",
            "no_auth", "log_level", "ray_address")
    return load_settings(**{k: getattr(args, k, None) for k in keys})


def _private_data_dir(s: Settings) -> None:
    """The data dir 0700 (also one an older version made 0755), and everything this process and
    its children create private (umask 077: files 0600, dirs 0700)."""
    os.umask(0o077)
    s.data_dir.mkdir(parents=True, exist_ok=True)
    s.data_dir.chmod(0o700)


def cmd_init(args: argparse.Namespace) -> int:
    """Convert the model and create the API key; print the key once, when it is created."""
    from .api import resolve_api_key
    from .models import resolve_model

    s = _settings(args)
    _private_data_dir(s)
    model_dir = resolve_model(s.model, s.models_dir, progress=_say)
    print(f"model: {model_dir}")
    if s.no_auth or s.api_key is not None:
        return 0
    existed = s.api_key_path.is_file()
    key = resolve_api_key(s)
    if existed:
        print(f"API key: already in {s.api_key_path}")
    else:
        print(f"API key (shown once; also in {s.api_key_path}): {key}")
    return 0


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def cmd_models(args: argparse.Namespace) -> int:
    """The model catalogue: what can be pulled, what is here, and pulling or removing one."""
    from . import models

    s = _settings(args)
    if args.action == "list":
        rows = []
        for entry in models.CATALOGUE.values():
            here = models.model_dir(s.models_dir, entry.name)
            done = models.partial_parts(entry, s.models_dir)
            state = ("pulled" if models.is_pulled(here) else
                     f"{done} of {len(entry.parts)} parts downloaded" if done else "not pulled")
            rows.append((entry.name, entry.parameters, f"{entry.size / 2**20:,.0f} MiB", state, entry.summary))
        for path in models.local_models(s.models_dir):
            rows.append((path.name, "", "", "pulled", models.read_manifest(path).get("summary", "")))
        header = ("name", "parameters", "download", "state", "summary")
        display.emit([dict(zip(header, r)) for r in rows], lambda listed: display.table(
            ("", *header), [("*" if m["name"] == s.model else "", *m.values()) for m in listed])
            + f"\n\n* the configured model; models live in {s.models_dir}", args.json)
        return 0
    if not args.name:
        raise ValueError(f"models {args.action} needs a model name (clawback models list)")
    if args.action == "pull":
        if args.name not in models.CATALOGUE and not args.name.endswith(".gguf"):
            raise ValueError(f"unknown model {args.name!r}: one of {', '.join(models.CATALOGUE)}, or a .gguf file")
        print(f"{args.name}: {models.resolve_model(args.name, s.models_dir, progress=_say)}")
        return 0
    for path in models.remove(args.name, s.models_dir):
        print(f"removed {path}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from .http import serve
    from .server import daemon_app

    s = _settings(args)
    _private_data_dir(s)
    logging.basicConfig(level=s.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = daemon_app(s)
    print(f"clawback: OpenAI-compatible API at {s.base_url}/v1 (model id '{s.served_model_name}')", flush=True)
    serve(app, s.host, s.port, s.log_level, s.client_timeout_s)
    return 0


def _daemon(args: argparse.Namespace, s: Settings) -> tuple[str, dict[str, str]]:
    """The running daemon's URL and auth header, from the same settings it was started with."""
    url = getattr(args, "url", None) or f"http://{'127.0.0.1' if s.host in ('0.0.0.0', '::') else s.host}:{s.port}"
    key = None if s.no_auth else (s.api_key.get_secret_value() if s.api_key else
                                  (s.api_key_path.read_text().strip() if s.api_key_path.is_file() else None))
    return url, ({"authorization": f"Bearer {key}"} if key else {})


def _call(method: str, url: str, headers: dict[str, str], body: JsonObject | None = None) -> JsonObject:
    import httpx

    r = httpx.request(method, url, headers=headers, json=body, timeout=60)
    if r.status_code >= 400:
        try:
            message = r.json()["error"]["message"]
        except Exception:
            message = r.text
        raise ValueError(f"{method} {url}: {r.status_code} {message}")
    return r.json()


def cmd_status(args: argparse.Namespace) -> int:
    import httpx

    s = _settings(args)
    url, headers = _daemon(args, s)
    try:
        status = _call("GET", f"{url}/v1/status", headers)
        status["daemon"] = "running"
    except (httpx.HTTPError, ValueError) as e:
        from dataclasses import asdict

        from .store import connect, counts

        if not s.db_path.is_file():
            print(f"daemon not reachable at {url} ({e}) and no store at {s.db_path}", file=sys.stderr)
            return 1
        conn = connect(s.db_path, readonly=True)
        try:
            store_counts = counts(conn)
        finally:
            conn.close()
        status = {"daemon": f"not reachable at {url} ({type(e).__name__})", "store": {"path": str(s.db_path), **asdict(store_counts)}}
    display.emit(status, lambda st: display.status_text(st, url), args.json)
    for warning in status.get("warnings", []):
        print(f"warning: {warning}", file=sys.stderr)
    return 0


def cmd_adapters(args: argparse.Namespace) -> int:
    s = _settings(args)
    url, headers = _daemon(args, s)
    if args.action == "list":
        display.emit(_call("GET", f"{url}/v1/adapters", headers), display.adapters_text, args.json)
        return 0
    if args.action in ("rollback", "pin", "unpin", "promote") and args.version is None:
        raise ValueError(f"adapters {args.action} needs a version (N, vN, or 'base' for rollback)")
    if args.action == "promote":
        from .adapters import promoted_summary

        display.emit(_call("POST", f"{url}/v1/adapters/promote", headers, {"version": args.version}), promoted_summary,
                     args.json)
        return 0
    if args.action == "rollback":
        out = _call("POST", f"{url}/v1/adapters/rollback", headers, {"version": args.version, "force": args.force})
        human = display.rollback_text
    elif args.action in ("pin", "unpin"):
        suffix = "?unpin=1" if args.action == "unpin" else ""
        out, human = _call("POST", f"{url}/v1/adapters/pin{suffix}", headers, {"version": args.version}), display.pin_text
    else:
        out, human = _call("POST", f"{url}/v1/adapters/prune", headers), display.prune_text
    display.emit(out, human, args.json)
    return 0


def cmd_openclaw(args: argparse.Namespace) -> int:
    from . import openclaw

    s = _settings(args)
    url, headers = _daemon(args, s)
    key = headers.get("authorization", "").removeprefix("Bearer ") or None
    oc = openclaw.OpenClawCli(args.openclaw)
    daemon = openclaw.Daemon(url, key)
    try:
        if args.action == "install":
            key_file = s.api_key_path if key and s.api_key is None else None

            def offline_model() -> JsonObject:  # the daemon's /v1/models entry, when it is not running
                from clawback.engine import read_model_info

                from .models import resolve_model

                info = read_model_info(resolve_model(s.model, s.models_dir))
                return {"id": s.served_model_name, "context_length": info.context_length}

            return openclaw.install(oc, daemon, s.data_dir, key_file, offline_model, plugin=args.plugin,
                                    make_default=args.make_default, slim=args.slim, max_tokens=args.max_tokens,
                                    restart=args.restart, verify=args.verify, assume_yes=args.yes)
        if args.action == "uninstall":
            return openclaw.uninstall(oc, s.data_dir, key)
        return openclaw.print_checks(openclaw.doctor(oc, daemon, test_turn=args.test_turn))
    except openclaw.SetupError as e:
        print(f"clawback openclaw {args.action}: {e}", file=sys.stderr)
        return 1


def cmd_dashboard(args: argparse.Namespace) -> int:
    """Print a one-time login link to the dashboard and open it where a browser exists."""
    import webbrowser

    import httpx

    s = _settings(args)
    url, headers = _daemon(args, s)
    try:
        link = url + _call("POST", f"{url}/v1/dashboard/link", headers)["path"]
    except httpx.HTTPError as e:
        raise ValueError(f"no daemon at {url} ({type(e).__name__}); start it with `clawback serve`") from None
    print(f"dashboard (this link logs in once, within 2 minutes): {link}")
    if not args.no_browser:
        with contextlib.suppress(webbrowser.Error):  # no browser here (a server): the printed link is the way in
            webbrowser.get().open(link)
    return 0


def _parse_since(value: str | None) -> float | None:
    from .forget import parse_time

    return None if value is None else parse_time(value)


def cmd_forget(args: argparse.Namespace) -> int:
    """Through the running daemon (it also drops what it holds in memory), else on the store."""
    import asyncio

    import httpx

    from .forget import forget, parse_time
    from .store import ForgetScope, Store

    s = _settings(args)
    before = None if args.before is None else parse_time(args.before)
    scope = ForgetScope(session_id=args.session, before=before, everything=args.all)
    url, headers = _daemon(args, s)
    body = {"session_id": scope.session_id, "before": scope.before, "all": scope.everything}
    try:
        report = _call("POST", f"{url}/v1/forget", headers, body)
    except httpx.ConnectError:
        if not s.db_path.is_file():
            raise FileNotFoundError(f"no store at {s.db_path}") from None
        store = Store(s.db_path)
        try:
            report = asyncio.run(forget(store, scope))
        finally:
            store.close()
    display.emit(report, display.forget_text, args.json)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from .store import export_jsonl

    s = _settings(args)
    if args.what == "adapter":
        return _export_adapter(args, s)
    if not args.jsonl:
        raise ValueError("export needs --jsonl (calls) or `adapter vN --format ...`")
    if not s.db_path.is_file():
        print(f"no store at {s.db_path}", file=sys.stderr)
        return 1
    since = _parse_since(args.since)
    if args.out and args.out != "-":
        with Path(args.out).open("w") as f:
            n = export_jsonl(s.db_path, f, since)
        print(f"wrote {n} records to {args.out}", file=sys.stderr)
    else:
        n = export_jsonl(s.db_path, sys.stdout, since)
    return 0


def cmd_memory(args: argparse.Namespace) -> int:
    s = _settings(args)
    url, headers = _daemon(args, s)
    if args.action == "edit":
        if args.note is None or not args.text:
            raise ValueError("memory edit needs a note id and the new text: clawback memory edit 3 'Use short replies.'")
        out = _call("PUT", f"{url}/v1/memory/{int(args.note)}", headers, {"text": " ".join(args.text)})
    elif args.action == "scope":
        if args.note is None or not args.text or args.text[0] not in ("general", "session") or len(args.text) > 2:
            raise ValueError("memory scope needs a note id, then general, or session and optionally its session id: "
                             "clawback memory scope 3 general")
        body = {"scope": args.text[0], **({"session_id": args.text[1]} if len(args.text) == 2 else {})}
        out = _call("PATCH", f"{url}/v1/memory/{int(args.note)}", headers, body)
    elif args.action == "forget":
        if args.note is None:
            raise ValueError("memory forget needs a note id, or 'all'")
        target = "" if args.note == "all" else f"/{int(args.note)}"
        out = _call("DELETE", f"{url}/v1/memory{target}", headers)
    else:
        out = _call("GET", f"{url}/v1/memory", headers)
    display.emit(out, display.memory_text, args.json)
    return 0


def _adapter_base(adapter_dir: Path, s: Settings) -> str:
    """The model a version was trained on, as its PEFT config records it (a model dir, or a
    catalogue name when that dir has moved); the configured model when it records none. The
    daemon's model may have changed since the version was trained."""
    from .models import CATALOGUE

    try:
        recorded = json.loads((adapter_dir / "adapter_config.json").read_text()).get("base_model_name_or_path")
    except (OSError, ValueError):
        recorded = None
    if not recorded:
        return s.model
    if Path(recorded).is_dir() or Path(recorded).name not in CATALOGUE:
        return recorded
    return Path(recorded).name


def _export_adapter(args: argparse.Namespace, s: Settings) -> int:
    from . import export
    from .models import resolve_model, source_gguf

    if args.version is None or args.format is None:
        raise ValueError("export adapter needs a version and --format (" + "|".join(export.FORMATS) + ")")
    name = Version.parse(args.version).name
    adapter_dir = s.data_dir / "adapters" / name
    if not adapter_dir.is_dir():
        raise ValueError(f"no adapter version {name} in {adapter_dir.parent}")
    suffix = ".gguf" if args.format.startswith("gguf") else ""
    out = Path(args.out) if args.out else Path(f"clawback-{name}-{args.format}{suffix}")
    if suffix and out.suffix != suffix:  # llama.cpp and Ollama go by the name: a GGUF file ends in .gguf
        out = out.with_name(out.name + suffix)
    if out.exists():  # before the model is pulled: a bad request changes nothing
        raise ValueError(f"{out} exists; choose another --out")
    model_dir = resolve_model(_adapter_base(adapter_dir, s), s.models_dir, progress=_say)
    base_gguf = Path(args.base_gguf) if args.base_gguf else source_gguf(model_dir)
    export.export_adapter(adapter_dir, model_dir, args.format, out, base_gguf)
    print(f"wrote {out} ({args.format} of adapter {name})")
    return 0


def main(argv: list[str] | None = None, commands: Sequence[Callable[[Subcommands], None]] = ()) -> int:
    """Parse and run; each of `commands` adds its subcommand to the subparsers it is given."""
    parser = argparse.ArgumentParser(prog="clawback", description="Serve, capture, judge, train.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("init", help="prepare the model and create the API key")
    _settings_flags(p)
    p.set_defaults(fn=cmd_init)

    p = sub.add_parser("models", help="the model catalogue: list, pull or remove a model")
    _settings_flags(p)
    p.add_argument("action", choices=["list", "pull", "rm"])
    p.add_argument("name", nargs="?", help="a catalogue name (pull: or a .gguf file)")
    p.add_argument("--json", action="store_true", help="list: JSON for scripts")
    p.set_defaults(fn=cmd_models)

    p = sub.add_parser("serve", help="run the daemon")
    _settings_flags(p)
    p.set_defaults(fn=cmd_serve)

    p = sub.add_parser("status", help="what the daemon and its store hold")
    _settings_flags(p)
    p.add_argument("--url", help="daemon URL (default from settings)")
    _json_flag(p)
    p.set_defaults(fn=cmd_status)

    p = sub.add_parser("adapters", help="list, roll back, promote, pin or prune adapter versions")
    _settings_flags(p)
    p.add_argument("action", choices=["list", "rollback", "promote", "pin", "unpin", "prune"])
    p.add_argument("version", nargs="?", help="N, vN, or 'base' (rollback)")
    p.add_argument("--force", action="store_true",
                   help="rollback: also to a version that was refused or rolled back from (retired)")
    p.add_argument("--url", help="daemon URL (default from settings)")
    _json_flag(p)
    p.set_defaults(fn=cmd_adapters)

    p = sub.add_parser("memory", help="the preference notes learned from your corrections: list, edit, scope, forget")
    _settings_flags(p)
    p.add_argument("action", choices=["list", "edit", "scope", "forget"])
    p.add_argument("note", nargs="?", help="note id (forget: or 'all')")
    p.add_argument("text", nargs="*", help="edit: the note's new text; scope: general, or session [SESSION_ID]")
    p.add_argument("--url", help="daemon URL (default from settings)")
    _json_flag(p)
    p.set_defaults(fn=cmd_memory)

    p = sub.add_parser("dashboard", help="open the dashboard with a one-time login link")
    _settings_flags(p)
    p.add_argument("--url", help="daemon URL (default from settings)")
    p.add_argument("--no-browser", action="store_true", help="only print the link")
    p.set_defaults(fn=cmd_dashboard)

    p = sub.add_parser("export", help="write sessions, calls and next states (--jsonl), or an adapter version")
    _settings_flags(p)
    p.add_argument("what", nargs="?", choices=["adapter"], help="adapter: export a trained version")
    p.add_argument("version", nargs="?", help="adapter version (N or vN)")
    p.add_argument("--format", choices=["peft", "merged", "gguf-lora", "gguf-merged"],
                   help="adapter: PEFT dir | merged HF model | llama.cpp LoRA GGUF | merged GGUF (Ollama)")
    p.add_argument("--base-gguf", help="adapter, gguf-merged: the base model's GGUF (default: the one a catalogue model was converted from)")
    p.add_argument("--jsonl", action="store_true", help="calls as JSON lines")
    p.add_argument("--since", help="only records from this time on (ISO 8601 or unix seconds)")
    p.add_argument("--out", help="output file or dir (default: stdout for --jsonl, ./clawback-vN-FORMAT for adapters)")
    p.set_defaults(fn=cmd_export)

    p = sub.add_parser("forget", help="delete what was stored about a session, an age, or everything")
    _settings_flags(p)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--session", help="this session (and the sessions linked to it)")
    which.add_argument("--before", help="every session last seen before this time (ISO 8601 or unix seconds)")
    which.add_argument("--all", action="store_true", default=False, help="everything")
    p.add_argument("--url", help="daemon URL (default from settings)")
    _json_flag(p)
    p.set_defaults(fn=cmd_forget)

    p = sub.add_parser("openclaw", help="connect an OpenClaw to this daemon (install), undo it, or check the chain")
    _settings_flags(p)
    p.add_argument("action", choices=["install", "uninstall", "doctor"])
    p.add_argument("--url", help="daemon URL (default from settings)")
    p.add_argument("--openclaw", default=os.environ.get("OPENCLAW", "openclaw"),
                   help="how to run the OpenClaw CLI (default: openclaw; e.g. \"node /path/openclaw.mjs\")")
    p.add_argument("--plugin", help="install this package spec (e.g. clawback, clawhub:clawback) instead of "
                                    "linking this checkout's extension/")
    p.add_argument("--make-default", action=argparse.BooleanOptionalAction, default=None,
                   help="make clawback/<model> the agents' default model (asked when interactive)")
    p.add_argument("--slim", action=argparse.BooleanOptionalAction, default=None,
                   help="the small-context profile (offered when the model has under 16 K tokens of context)")
    p.add_argument("--max-tokens", type=int, default=0, help="reply cap in the model entry (default context/8)")
    p.add_argument("--restart", action=argparse.BooleanOptionalAction, default=True,
                   help="run `openclaw gateway restart` after install (default on)")
    p.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True,
                   help="send one test turn through OpenClaw and confirm it arrived tagged (default on)")
    p.add_argument("--yes", "-y", action="store_true", help="take the defaults without asking")
    p.add_argument("--test-turn", action="store_true", help="doctor: first send one test turn through OpenClaw")
    p.set_defaults(fn=cmd_openclaw)

    for add in commands:
        add(sub)

    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except Exception as e:  # a clear one-line error instead of a traceback for user mistakes
        if isinstance(e, (FileNotFoundError, ValueError)) or type(e).__name__ in ("ModelNotFound", "PullError"):
            print(f"clawback: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
