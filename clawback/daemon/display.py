"""What the CLI and the dashboard say to people: sentences and tables made from the daemon's JSON.

The CLI prints these by default and the JSON itself with `--json` (for scripts); the dashboard uses
the same words for a sample's state and its reason."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from clawback.records import JsonObject, Version

T = TypeVar("T")  # the daemon's JSON reply, or the list a command printed

# Why a sample is not trained on (samples.reason), in words.
SAMPLE_REASONS = {
    "held_out": "held out for the gate: it checks new versions against this rating and never trains on it",
    "cut_off": "the reply was cut off by its token limit (max_tokens) before it ended",
    "empty_reply": "the reply has no tokens (the client hung up first, or generation failed)",
    "empty_response": "the reply has no tokens",
    "no_content": "the reply has no visible text and no tool call",
    "repetition_loop": "the reply repeats itself in a loop",
    "no_signal": "nothing to learn from: no rating, correction or judge verdict",
    "judge_failed": "the judge failed on it",
    "teacher_context_too_long": "the request with the hint does not fit the model's context",
    "teacher_version_unloaded": "the version that served it is no longer loaded",
    "stale": "too many versions trained since it was served",
    "no_teacher_for_opd": "on-policy distillation needs a hint or correction, and it has none",
    # Why a sample with a teacher trains token-level OPD (samples.token_level_reason)
    "no_top_k_recorded": "the call was served without the policy's top-K (opd_top_k = 0, or the engine sent none)",
    "candidate_scoring_failed": "the engine could not score the teacher's view of the top-K",
    "notes_teacher": "a liked reply taught by the base model told your notes: only the words it said are raised",
}
SAMPLE_STATES = {"pending_judge": "waiting for the judge", "ready": "ready to train on"}


def sample_reason(reason: str | None) -> str:
    """A dropped sample's reason in words (the code itself when it has no wording here)."""
    if not reason:
        return "no reason recorded"
    code, _, detail = reason.partition(": ")
    words = SAMPLE_REASONS.get(code, code.replace("_", " "))
    return f"{words}: {detail}" if detail else words


def sample_state(state: str | None, reason: str | None = None, consumed_version: str | None = None) -> str:
    """One sample's state with why: 'held out for the gate ...', 'dropped: the reply was cut off ...'."""
    if state is None:
        return "no sample"
    if state == "dropped" and reason == "held_out":
        return SAMPLE_REASONS["held_out"]
    if state == "dropped":
        return f"dropped: {sample_reason(reason)}"
    if state == "consumed":
        return f"trained into {consumed_version}" if consumed_version else "trained on"
    return SAMPLE_STATES.get(state, state.replace("_", " "))


def reward_origin(reward: float | None, source: str | None, outcome: str | None = None) -> str:
    """A sample's reward and where it came from: 'reward -1 from outcome rule test_summary'."""
    if reward is None or source in (None, "none"):
        return "no reward"
    origin = {"explicit": f"the person's {'👍' if reward > 0 else '👎'}", "judge": "the judge",
              "outcome_rule": f"outcome rule {outcome}", "outcome_event": f"outcome event from {outcome}"}
    return f"reward {reward:+.2g} from {origin.get(source, source)}"


def ago(ts: float | None, now: float | None = None) -> str:
    if ts is None:
        return "never"
    s = max(0.0, (time.time() if now is None else now) - ts)
    for unit, n in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= n:
            return f"{s / n:.0f} {unit} ago"
    return f"{s:.0f} s ago"


def duration(seconds: float) -> str:
    s = int(seconds)
    if s >= 86400:
        return f"{s // 86400} d {s % 86400 // 3600} h"
    if s >= 3600:
        return f"{s // 3600} h {s % 3600 // 60} min"
    return f"{s // 60} min {s % 60} s" if s >= 60 else f"{s} s"


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Columns padded to their widest cell; the last column is not padded."""
    cells = [[str(c) for c in header], *[["" if c is None else str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + ("  " if len(r) > 1 else "") + r[-1]
                     for r in cells).rstrip()


def counted(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else (many or one + 's')}"


def emit(data: T, human: Callable[[T], str], as_json: bool) -> None:
    print(json.dumps(data, indent=2, ensure_ascii=False) if as_json else human(data))


def version(v: int | str | None) -> str:
    if v is None:
        return "the base model"
    return Version.parse(v).name


# ---------------------------------------------------------------- clawback status

def _calls(calls: dict[str, int]) -> tuple[dict[str, int], int]:
    """Main calls by state, and the number of side calls, from counts' 'turn/state' keys."""
    main = {k.split("/", 1)[1]: n for k, n in calls.items() if k.startswith("main/")}
    side = sum(n for k, n in calls.items() if not k.startswith("main/"))
    return main, side


def status_text(s: JsonObject, url: str) -> str:
    store = s.get("store") or {}
    main, side = _calls(store.get("calls", {}))
    n_main = sum(main.values())
    waiting = main.get("awaiting_next_state", 0)
    samples: dict[str, int] = store.get("samples", {})
    feedback: dict[str, int] = store.get("feedback", {})
    lines = []
    if s.get("daemon") != "running":
        lines.append(f"daemon: {s.get('daemon')}; what its store holds:")
    else:
        lines += [f"daemon: running at {url} for {duration(s['uptime_s'])} (clawback {s['version']})",
                  f"model: {s['model']}, served as '{s['served_model_name']}', {s['context_length']} tokens of "
                  f"context; serving {version(s['adapter_version'])}"]
    lines.append(f"main calls: {n_main} ({main.get('paired', 0)} paired with a next state, {waiting} waiting for one); "
                 f"side calls: {side}" + (f"; sessions open: {s['sessions_open']}" if "sessions_open" in s else ""))
    training = s.get("training")
    ready = samples.get("ready", 0)
    others = ", ".join(f"{n} {SAMPLE_STATES.get(k, k.replace('_', ' '))}" for k, n in sorted(samples.items())
                       if k not in ("ready", "dropped"))
    line = f"samples: {ready}" + (f" of {training['batch_size']} ready for the next training step" if training else " ready")
    lines.append(line + (f"; {others}" if others else ""))
    dropped: dict[str, int] = store.get("dropped_samples", {})
    for reason, n in sorted(dropped.items(), key=lambda kv: -kv[1]):
        label = "held out" if reason == "held_out" else "dropped"
        lines.append(f"  {n} {label}: {sample_reason(reason)}")
    if training:
        last = training.get("last_step")
        step = ("no training step yet" if last is None else
                f"last step {ago(last['finished_at'])}: {last['outcome']}"
                + (f", v{last['version']}" if last.get("version") is not None else "") + f" ({last['samples']} samples)")
        lines.append(f"training: {'on' if training['enabled'] else 'off'}"
                     + (" (training now)" if training.get("training_now") else "") + f"; {step}")
    sig = s.get("signals")
    n_fb = sum(feedback.values())
    fb = f"feedback: {counted(n_fb, 'event')}" + (
        " (" + ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in sorted(feedback.items())) + ")" if feedback else "")
    if sig:
        fb += f"; {counted(sig['feedback_connections'], 'OpenClaw plugin connection')}; judge: {sig['judge']}"
    lines.append(fb)
    if "memory" in s:
        notes = s["memory"]["notes"]
        lines.append(f"memory: {'on' if s['memory']['enabled'] else 'off'}, {counted(len(notes), 'note')}"
                     + (" (clawback memory list)" if notes else ""))
    gate = s.get("gate")
    if gate and gate.get("enabled"):
        newest = gate.get("newest")
        lines.append(f"gate: {gate['promoted']} promoted, {gate['refused']} refused"
                     + (f"; newest v{newest['version']} {newest['state']}" + (f": {newest['reason']}" if newest.get("reason")
                                                                                else "") if newest else ""))
    lines.append(f"store: {store.get('path')}")
    return "\n".join(lines)


# ---------------------------------------------------------------- clawback adapters, forget, memory

def adapters_text(out: JsonObject) -> str:
    rows = []
    for a in out["data"]:
        m = a["metrics"]
        retention = (a.get("gate") or {}).get("retention")
        loss, reward = m.get("loss"), m.get("reward_mean")
        rows.append([Version(a["version"]).name, a["state"] + (" (live)" if a["version"] == out["live"] and a["state"] != "live" else ""),
                     "yes" if a["pinned"] else "", Version.name_of(a["parent"]) or "base", a["samples"],
                     "–" if loss is None else f"{loss:.4f}", "–" if reward is None else f"{reward:+.2f}",
                     f"{retention['candidate']:.0f}/100" if retention else "–"])
    head = f"live: {'base model' if out['live'] is None else 'v' + str(out['live'])}"
    if not rows:
        return head + "\nno adapter version yet: training makes one once enough rated replies are ready"
    refused = [f"{Version(a['version']).name} not promoted: {a['reason']}" for a in out["data"] if a["state"] == "refused"]
    return "\n".join([head, table(["version", "state", "pinned", "parent", "samples", "loss", "reward", "probes kept"],
                                   rows), *refused])


def rollback_text(out: JsonObject) -> str:
    return f"{version(out['live'])} is live now (swapped in {out['swap_s']:.2f} s)"


def pin_text(out: JsonObject) -> str:
    return (f"{Version(out['version']).name} pinned: prune keeps it" if out["pinned"] else
            f"{Version(out['version']).name} unpinned: prune may delete it")


def prune_text(out: JsonObject) -> str:
    pruned = out["pruned"]
    return "nothing to prune" if not pruned else "pruned " + ", ".join(version(v) for v in pruned)


def forget_text(report: JsonObject) -> str:
    deleted = {k: n for k, n in report["deleted"].items() if n}
    what = ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in deleted.items()) or "nothing was stored"
    lines = [f"forgot {counted(report['sessions'], 'session')}: {what}"]
    scrubbed = report.get("scrubbed") or {}
    if scrubbed.get("calls"):
        lines.append(f"took the forgotten notes out of {counted(scrubbed['calls'], 'call')} of other sessions that "
                     f"were served with them; {counted(scrubbed['samples_dropped'], 'sample')} not yet trained "
                     "on went with them")
    affected = report["affected_versions"]
    if affected:
        target = report["rollback_to"]
        lines.append(f"adapter versions {', '.join(version(v) for v in affected)} were trained on forgotten data and "
                     "still carry what they learnt from it; to stop serving it: "
                     f"clawback adapters rollback {'base' if target is None else target}")
    return "\n".join(lines)


def note_retirement(note: JsonObject, live: str | None) -> str:
    """', retired by v3' for a note the live version no longer needs, and whether it is injected
    again after a rollback below that version."""
    if note["retired_by"] is None:
        return ""
    return f", retired by v{note['retired_by']}" + (f"; injected while {live or 'base'} serves" if note["active"] else "")


def note_scope(note: JsonObject) -> str:
    return "general" if note["scope"] == "general" else f"session {note['session_id']} only"


def memory_text(out: JsonObject) -> str:
    lines = [f"memory {'on' if out['enabled'] else 'off'}: {len(out['data'])} of at most {out['max_notes']} notes"]
    lines += [f"{n['note_id']:>4}  {n['text']}  ({n['source']}, {note_scope(n)}{note_retirement(n, out['live'])})"
              for n in out["data"]]
    return "\n".join(lines)
