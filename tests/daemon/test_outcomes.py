"""Outcome rules on real tool-result shapes, and outcome events' credit assignment in a real store.

The runner outputs in tool_results/ were captured by running each runner on a small failing or
passing project: pytest 9.0.3, unittest (Python 3.11), cargo test (cargo 1.95), `node --test`
(Node 20), vitest 5.1.2 (Node 24), a Python traceback and a Node error stack. jest and `go test`
are not installed here: jest_fail.txt and go_test_*.txt are transcribed from their output format.
OpenClaw's exec tool results are built as OpenClaw 2026.9.6 builds them (see `exec_result`)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import replace
from pathlib import Path

import pytest
from pydantic import ValidationError

from clawback.daemon.config import OutcomeSettings, Settings
from clawback.daemon.feedback import FeedbackEvent
from clawback.daemon.outcomes import RULES, evidence, read_result, tool_outcome
from clawback.daemon.store import Store
from clawback.records import FeedbackRecord, Outcome
from tests.daemon.test_samples import engine, renderer  # noqa: F401, F811  (fixtures)
from tests.daemon.test_store import record

SHAPES = Path(__file__).parent / "tool_results"
ALL = tuple(RULES)


def shape(name: str) -> str:
    return (SHAPES / name).read_text()


def exec_result(output: str, exit_code: int) -> str:
    """OpenClaw's exec tool result text (dist/bash-tools.exec-runtime: buildExecExitOutcome): the
    output, and after a blank line `(Command exited with code N)` when N is not 0 ("(no output)"
    when there was none)."""
    return (output or "(no output)") + (f"\n\n(Command exited with code {exit_code})" if exit_code else "")


def tool(content: str | list, call_id: str = "call_1") -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


@pytest.mark.parametrize("name, passed", [
    ("pytest_fail.txt", False), ("pytest_pass.txt", True), ("unittest_fail.txt", False),
    ("unittest_pass.txt", True), ("cargo_test_fail.txt", False), ("cargo_test_pass.txt", True),
    ("node_test_fail.txt", False), ("vitest_fail.txt", False), ("jest_fail.txt", False),
    ("go_test_fail.txt", False), ("go_test_pass.txt", True),
])
def test_test_summaries_decide_through_openclaws_exec(name: str, passed: bool):
    rule, verdict = read_result(exec_result(shape(name), 0 if passed else 1), ALL)
    assert (rule, verdict.passed) == ("test_summary", passed)


def test_a_run_without_tests_says_nothing():
    assert read_result("no tests ran in 0.01s", ALL) is None
    assert read_result("\n----------------------------------------------------------------------\n"
                       "Ran 0 tests in 0.000s\n\nOK\n", ALL) is None
    assert read_result("test result: ok. 0 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out", ALL) is None


def test_a_failure_anywhere_in_a_multi_crate_cargo_run_fails_it():
    text = shape("cargo_test_pass.txt") + shape("cargo_test_fail.txt")
    assert read_result(text, ALL)[1].passed is False


@pytest.mark.parametrize("name, last_line", [
    ("python_traceback.txt", "FileNotFoundError: [Errno 2] No such file or directory: 'config.json'"),
    ("node_error_stack.txt", "at node:internal/main/run_main_module:28:49"),
])
def test_stack_traces_fail_and_their_end_is_the_evidence(name: str, last_line: str):
    text = exec_result(shape(name), 1)
    rule, verdict = read_result(text, ALL)
    assert (rule, verdict.passed) == ("traceback", False)
    assert evidence(text, verdict.end).endswith(last_line)
    assert "Traceback" in evidence(text, verdict.end) or "TypeError: Cannot read properties" in evidence(text, verdict.end)


@pytest.mark.parametrize("text, passed", [
    (exec_result("ls: cannot access 'nope': No such file or directory", 2), False),
    (exec_result("", 1), False),
    # exec's failed starts (dist/bash-tools.exec-runtime formatExecFailureReason), after the output
    ("sh: 1: frobnicate: not found\n\nCommand not found", False),
    ("Command timed out after 5 seconds. If this command is expected to take longer, re-run with a higher timeout.",
     False),
    ("partial output\n\nCommand aborted by signal SIGKILL", False),
    # exec on a paired node: stdout, stderr and the exit line joined by newlines (formatNodeRunToolResult)
    ("Node: mac-mini\nboom\n(Command exited with code 3)", False),
    (json.dumps({"exitCode": 0, "stdout": "done"}), True),
    (json.dumps({"returncode": 1, "stderr": "bad"}), False),
])
def test_exit_codes(text: str, passed: bool):
    rule, verdict = read_result(text, ALL)
    assert (rule, verdict.passed) == ("exit_code", passed)


def test_a_zero_exit_of_openclaws_exec_says_nothing():
    """OpenClaw prints nothing on a zero exit, so plain output is no outcome (the judge's to read)."""
    assert read_result(exec_result("a.txt\nb.txt", 0), ALL) is None
    assert read_result(exec_result("", 0), ALL) is None


def test_openclaws_tool_error_object_fails():
    """What OpenClaw's tool wrapper returns when a tool throws (agent-tool-definition-adapter:
    jsonResult({status: "error", tool, error}), pretty-printed)."""
    text = json.dumps({"status": "error", "tool": "read", "error": "ENOENT: no such file or directory, open 'x'"},
                      indent=2)
    rule, verdict = read_result(text, ALL)
    assert (rule, verdict.passed) == ("error_object", False)
    assert "ENOENT" in evidence(text, verdict.end)
    assert read_result(json.dumps({"status": "ok", "tool": "read"}), ALL) is None


def test_a_call_of_a_tool_openclaw_does_not_have_fails():
    """OpenClaw's agent loop answers a call of a tool it does not have with an error result
    (pi-agent-core: createErrorToolResult(`Tool ${name} not found`))."""
    rule, verdict = read_result("Tool count_logs not found", ALL)
    assert (rule, verdict.passed) == ("unknown_tool", False)
    assert evidence("Tool count_logs not found", verdict.end) == "Tool count_logs not found"
    assert read_result("grep: Tool x not found in notes.txt", ALL) is None  # a command's output that says it


def test_rules_are_tried_in_the_configured_order_and_can_be_left_out():
    text = exec_result(shape("pytest_fail.txt"), 1)
    assert read_result(text, ("exit_code", "test_summary"))[0] == "exit_code"
    assert read_result(text, ("traceback",)) is None
    assert read_result(text, ()) is None


def test_a_calls_outcome_over_its_tool_results():
    failing = tool(exec_result(shape("python_traceback.txt"), 1), "call_2")
    passing = tool(exec_result(shape("pytest_pass.txt"), 0))
    silent = tool("a.txt\nb.txt", "call_3")
    assert tool_outcome([passing, silent], ALL, 0.5, -1.0) == Outcome(0.5, "test_summary")
    out = tool_outcome([passing, failing, {"role": "user", "content": "Traceback (most recent call last):"}],
                       ALL, 1.0, -0.5)
    assert (out.reward, out.origin) == (-0.5, "traceback")
    assert out.text.startswith("The tool call in this reply fails. The tool said:\nTraceback")
    assert out.text.endswith("No such file or directory: 'config.json'")
    assert tool_outcome([silent], ALL, 1.0, -1.0) is None
    assert tool_outcome(None, ALL, 1.0, -1.0) is None
    parts = tool([{"type": "text", "text": exec_result("boom", 1)}])  # content as a list of parts
    assert tool_outcome([parts], ALL, 1.0, -1.0).origin == "exit_code"


def test_evidence_is_the_end_of_the_output_from_a_line_start():
    text = "\n".join(f"line {i}" for i in range(500)) + "\n1 failed in 0.1s\ntrailing"
    _, verdict = read_result(text, ALL)
    ev = evidence(text, verdict.end, limit=40)
    assert ev.endswith("1 failed in 0.1s") and ev.startswith("line ") and len(ev) <= 40


def test_outcome_settings():
    s = Settings(signals={"outcomes": {"rules": ["exit_code"], "failure_reward": -0.5, "credit": "every"}})
    cfg = s.signal_config()
    assert (cfg.outcome_rules, cfg.outcome_failure, cfg.outcome_success) == (("exit_code",), -0.5, 1.0)
    assert Settings(signals={"outcomes": {"enabled": False}}).signal_config().outcome_rules == ()
    assert Settings().signal_config().outcome_rules == ALL
    with pytest.raises(ValidationError, match="no outcome rule exit_status"):
        OutcomeSettings(rules=["exit_status"])
    with pytest.raises(ValidationError):
        OutcomeSettings(success_reward=2)


def test_outcome_settings_from_clawback_toml(tmp_path: Path):
    (tmp_path / "clawback.toml").write_text('[signals.outcomes]\nrules = ["test_summary"]\ncredit = "step"\n')
    s = Settings(data_dir=tmp_path)
    assert s.signals.outcomes.rules == ("test_summary",) and s.signals.outcomes.credit == "step"


# ---------------------------------------------------------------- outcome events in the store


def outcome_event(session: str = "s1", reward: float = -1.0, **kw) -> FeedbackRecord:
    """An outcome event as the daemon stores it: validated, its credit filled in."""
    ev = FeedbackEvent.model_validate({"event_id": str(uuid.uuid4()), "kind": "outcome", "session_id": session,
                                       "reward": reward, "source": "ci", "credit": "last", **kw})
    return ev.record()


@pytest.fixture
def store(tmp_path: Path):
    s = Store(tmp_path / "clawback.db")
    yield s
    s.close()


def trajectory(store: Store, session: str, turns: list[str]) -> list[str]:
    """Main calls of one session, one per entry of `turns` (their turn ids), oldest first."""
    ids = []
    for i, turn in enumerate(turns):
        call_id = f"{session}-c{i}"
        store.add_call(replace(record(call_id, session, t=100.0 + i), turn_id=turn))
        ids.append(call_id)
    store.flush()
    return ids


def apply(store: Store, ev: FeedbackRecord) -> dict:
    return asyncio.run(store.apply_feedback(ev, time.time()))


def credited(store: Store, ev: FeedbackRecord) -> dict[str, float]:
    return dict(store.read(lambda c: c.execute("SELECT call_id, reward FROM outcome_rewards WHERE event_id = ?",
                                               (ev.event_id,)).fetchall()))


@pytest.mark.parametrize("credit, expected", [("last", {"s1-c2": -1.0}),
                                              ("every", {"s1-c0": -1.0, "s1-c1": -1.0, "s1-c2": -1.0})])
def test_last_and_every_credit(store: Store, credit: str, expected: dict):
    calls = trajectory(store, "s1", ["t0", "t0", "t1"])
    ev = outcome_event(credit=credit, text="2 tests failed")
    assert apply(store, ev) == {"status": "applied", "call_id": calls[-1], "reason": None}
    assert credited(store, ev) == expected
    pending = store.pending_samples(10)
    assert sorted(c for c, _ in pending) == sorted(expected)
    inp = store.sample_inputs(calls[-1])
    assert inp.outcome == Outcome(-1.0, "ci", "2 tests failed")
    assert apply(store, ev)["status"] == "duplicate" and credited(store, ev) == expected


def test_targets_and_turn_ranges_choose_the_trajectory(store: Store):
    calls = trajectory(store, "s1", ["t0", "t1", "t1", "t2", "t3"])
    ev = outcome_event(target="t1", credit="every")
    apply(store, ev)
    assert sorted(credited(store, ev)) == calls[1:3]
    ev = outcome_event(target="req-s1-c3", credit="every")
    apply(store, ev)
    assert list(credited(store, ev)) == [calls[3]]
    ev = outcome_event(turns=["t1", "t2"], credit="every")
    apply(store, ev)
    assert sorted(credited(store, ev)) == calls[1:4]
    ev = outcome_event(target="last", credit="every")
    apply(store, ev)
    assert list(credited(store, ev)) == [calls[4]]
    for bad in ({"target": "t9"}, {"turns": ["t3", "t1"]}):
        ev = outcome_event(**bad)
        assert apply(store, ev) == {"status": "orphan", "call_id": None, "reason": "unknown_target"}
        assert credited(store, ev) == {}
    assert apply(store, outcome_event("nobody"))["reason"] == "unknown_session"


def test_a_success_gives_no_hint(store: Store):
    calls = trajectory(store, "s1", ["t0"])
    apply(store, outcome_event(reward=1.0, text="all 12 tests passed"))
    assert store.sample_inputs(calls[0]).outcome == Outcome(1.0, "ci", None)


def test_step_credit_normalises_per_step_index_within_a_group(store: Store):
    """Upstream's step-wise normalisation: z-scores among the group's calls at one step index; a
    step only the longest trajectory reached keeps its raw reward; a step where all agree gets 0."""
    a = trajectory(store, "a", ["a0", "a1", "a2"])
    b = trajectory(store, "b", ["b0", "b1"])
    c = trajectory(store, "c", ["c0", "c1"])
    apply(store, outcome_event("a", 1.0, credit="step", group="task-1"))
    ev_b = outcome_event("b", -1.0, credit="step", group="task-1")
    apply(store, ev_b)
    # two trajectories, +1 and -1: z = ±1 at steps 0 and 1; step 2 only `a` reached: raw +1
    assert {k: round(v, 4) for k, v in credited(store, ev_b).items()} == {b[0]: -1.0, b[1]: -1.0}
    rewards = dict(store.read(lambda conn: conn.execute("SELECT call_id, reward FROM outcome_rewards").fetchall()))
    assert [round(rewards[x], 4) for x in a] == [1.0, 1.0, 1.0]
    store.flush()
    revision_before = dict(store.pending_samples(10))[a[0]]
    apply(store, outcome_event("c", 1.0, credit="step", group="task-1"))
    rewards = dict(store.read(lambda conn: conn.execute("SELECT call_id, reward FROM outcome_rewards").fetchall()))
    # +1, -1, +1: mean 1/3, std 0.943: +0.707 each for a and c, -1.414 clipped to -1 for b
    assert [round(rewards[x], 3) for x in (a[0], b[0], c[0])] == [0.707, -1.0, 0.707]
    assert round(rewards[a[2]], 3) == 1.0, "the extra tail step keeps its raw reward"
    assert dict(store.pending_samples(10))[a[0]] > revision_before, "a changed reward queues the sample again"
    apply(store, outcome_event("b", 1.0, credit="step", group="task-2"))
    apply(store, outcome_event("c", 1.0, credit="step", group="task-2"))
    rewards = dict(store.read(lambda conn: conn.execute(
        "SELECT call_id, reward FROM outcome_rewards WHERE group_id = 'task-2'").fetchall()))
    assert set(rewards.values()) == {0.0}, "every trajectory scored the same: no advantage"


def test_without_a_group_step_credit_gives_each_call_the_raw_reward(store: Store):
    calls = trajectory(store, "s1", ["t0", "t1"])
    ev = outcome_event(credit="step", reward=-0.5)
    apply(store, ev)
    assert credited(store, ev) == {calls[0]: -0.5, calls[1]: -0.5}


def test_forgetting_a_session_forgets_its_outcome_rewards(store: Store):
    from clawback.daemon.store import ForgetScope

    trajectory(store, "s1", ["t0", "t1"])
    keep = trajectory(store, "s2", ["t0"])
    apply(store, outcome_event("s1", credit="every"))
    apply(store, outcome_event("s2"))
    asyncio.run(store.forget(ForgetScope(session_id="s1")))
    left = store.read(lambda c: c.execute("SELECT call_id FROM outcome_rewards").fetchall())
    assert [r[0] for r in left] == keep


# ---------------------------------------------------------------- in the sample pipeline


@pytest.mark.parametrize("rules, signals, expected", [
    (ALL, (), ("ready", -1.0, "outcome_rule", "traceback", "outcome")),
    ((), (), ("dropped", 0.0, "none", None, None)),  # rules off, no judge: nothing to learn from
    (ALL, ("thumbs_up",), ("ready", 1.0, "explicit", None, "outcome")),  # the person decides; the error is the hint
    (ALL, ("outcome",), ("ready", 0.5, "outcome_event", "ci", None)),  # an environment's verdict beats a rule
])
def test_where_the_reward_comes_from(tmp_path, engine, renderer, rules, signals, expected):  # noqa: F811
    """With the pipeline on a real engine (tiny random Llama) and store: a call whose exec tool
    result is a Python traceback, and the signals a person or an environment add."""
    from tests.daemon.test_samples import drain, feedback, pipe, sample_row, served_call

    store = Store(tmp_path / "db.sqlite")
    try:
        call_id = served_call(store, renderer, engine, [tool(exec_result(shape("python_traceback.txt"), 1))])
        for kind in signals:
            if kind == "outcome":
                apply(store, outcome_event("s", 0.5, target=call_id, text=None))
            else:
                feedback(store, kind)
        drain(pipe(store, engine, renderer, None, method="combined", outcome_rules=rules))
        row = sample_row(store, call_id)
        assert (row["state"], row["reward"], row["reward_source"], row["outcome"], row["hint_source"]) == expected
        if row["hint_source"] == "outcome":
            assert row["hint"].endswith("No such file or directory: 'config.json'") and row["teacher_logprobs"]
    finally:
        store.close()


def guarded_v1(tmp_path, store, renderer, engine):  # noqa: F811
    """Adapter slots without a model (tests/daemon/engine_slots.py), as the guard only swaps them;
    v1 committed; the base model's 20 replies, whose commands failed 2 times; a live guard over 10
    replies. Returns (adapters, guard, versions root, an ok and a failed exec result)."""
    from clawback.daemon.adapters import AdapterManager
    from clawback.daemon.config import GateConfig
    from clawback.daemon.guard import LiveGuard
    from tests.daemon.engine_slots import Slots
    from tests.daemon.test_loop_decisions import versions
    from tests.daemon.test_samples import served_call

    adapters = AdapterManager(Slots(), store, tmp_path / "live", keep=2)  # type: ignore[arg-type]
    root = versions(tmp_path, store, 1)
    ok, failed = tool(exec_result("43 maple_4.txt", 0)), tool(exec_result(shape("python_traceback.txt"), 1))
    for k in range(20):
        served_call(store, renderer, engine, [failed if k < 2 else ok])
    return adapters, LiveGuard(store, adapters, GateConfig(guard_replies=10, guard_baseline=200)), root, ok, failed


def test_the_live_guard_rolls_back_a_version_whose_tool_calls_start_to_fail(tmp_path, engine, renderer):  # noqa: F811
    """Rewards from exec tool results through the real pipeline (tiny random Llama, real store); the
    adapter slots without a model (tests/daemon/engine_slots.py), as the guard only swaps them.
    The base model's commands failed 2 times in 20; v1's start to fail, and no person rates any."""
    from tests.daemon.test_samples import drain, pipe, served_call

    store = Store(tmp_path / "db.sqlite")
    try:
        adapters, guard, root, ok, failed = guarded_v1(tmp_path, store, renderer, engine)
        asyncio.run(adapters.go_live(1, str(root / "v1")))

        def serve_v1(fails: int, fine: int = 0) -> dict:
            for state in [failed] * fails + [ok] * fine:
                served_call(store, renderer, engine, [state], adapter_version=1)
            drain(pipe(store, engine, renderer, None, method="binary"))
            return asyncio.run(guard.check())

        check = serve_v1(4)  # 4 of 10 against 2 of 20: p = 0.076, not a rise
        assert check["old"] == {"thumbs_down": 0, "correction": 0, "failed_outcome": 2}
        assert check["new"]["failed_outcome"] == 4 and check["tests"]["failed_outcome"] == pytest.approx(0.07604, abs=1e-5)
        assert adapters.live() == 1 and "rolled_back" not in check
        check = serve_v1(3, 3)  # 7 of 10: p = 0.0017
        assert adapters.live() is None and check["rolled_back"] == (
            "rolled back after going live: failed tool outcome rate 7/10 vs 2/20 on base "
            "(Fisher one-sided p=0.00166 < 0.0167)")
        assert store.adapters()[0].state == "refused"
    finally:
        store.close()


def test_the_live_guard_leaves_a_version_the_person_promotes_while_it_counts(tmp_path, engine, renderer):  # noqa: F811
    """v1's tool calls fail 7 times in 10 against 2 in 20 on the base, a significant rise; while
    the guard counts them the person promotes v1 by hand (`clawback adapters promote 1`), and
    the guard's rollback would undo what the person just did."""
    from tests.daemon.test_samples import drain, pipe, served_call

    store = Store(tmp_path / "db.sqlite")
    try:
        adapters, guard, root, ok, failed = guarded_v1(tmp_path, store, renderer, engine)
        for k in range(10):
            served_call(store, renderer, engine, [failed if k < 7 else ok], adapter_version=1)
        drain(pipe(store, engine, renderer, None, method="binary"))
        counted = guard._feedback

        async def check():
            await adapters.go_live(1, str(root / "v1"))
            loop = asyncio.get_running_loop()

            def promote_meanwhile(live, parent):
                asyncio.run_coroutine_threadsafe(adapters.promote(1), loop).result(60)
                return counted(live, parent)

            guard._feedback = promote_meanwhile  # type: ignore[method-assign]
            return await guard.check()

        result = asyncio.run(check())
        assert result is not None and result["tests"]["failed_outcome"] < 0.0167  # a rise the guard acts on ...
        assert adapters.live() == 1 and "rolled_back" not in result  # ... but the person put v1 live
        assert store.adapters()[0].state == "live"
    finally:
        store.close()
