"""The shell scenario's sandbox and task checkers, on the real sandbox (bubblewrap where it runs
here, and the rlimits fallback): every task is solved by its solution command and not by a
plausible wrong one; a command cannot leave its directory, reach the network, outlive its limits
or flood the result."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import pytest

from clawback.sim import sandbox as sb
from clawback.sim.harness import SimError
from clawback.sim.sandbox import ExecResult, Sandbox, escapes, task_directory
from clawback.sim.shell import run_episode, send_outcome, task_order
from clawback.sim.shell_tasks import EVAL, TRAIN, Verdict, regular_files

SECRET = f"s3cret-{uuid.uuid4().hex}\n"
BACKENDS = ["rlimits"] + (["bwrap"] if Sandbox.detect().backend == "bwrap" else [])


@pytest.fixture(params=BACKENDS)
def sandbox(request) -> Sandbox:
    return Sandbox(request.param)


@pytest.fixture
def workdir():
    d = task_directory()
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def outside():
    """A file next to the task directories, which no command may read or change."""
    path = Path(tempfile.gettempdir()) / f"clawback-outside-{uuid.uuid4().hex}"
    path.write_text(SECRET)
    yield path
    path.unlink(missing_ok=True)


@pytest.mark.parametrize("task", TRAIN + EVAL, ids=lambda t: t.key)
def test_each_checker_passes_the_solution_and_fails_a_wrong_command(task, sandbox: Sandbox):
    for command, solved in ((task.solution, True), (task.wrong, False)):
        d = task_directory()
        try:
            task.make(d)
            verdict = task.check(d, sandbox.run(command, d), sandbox)
        finally:
            shutil.rmtree(d)
        assert verdict.solved is solved, (command, verdict)


def test_a_task_is_decided_by_what_ran_not_by_what_was_said(sandbox: Sandbox, workdir: Path):
    answer_task = next(t for t in TRAIN if t.answer is not None)
    answer_task.make(workdir)
    assert answer_task.check(workdir, None, sandbox) == Verdict(False, "no command was run")
    said = sandbox.run(f"echo The answer is {answer_task.answer}", workdir)  # more than the answer alone
    assert not answer_task.check(workdir, said, sandbox).solved
    failed = sandbox.run(f"echo {answer_task.answer}; exit 1", workdir)  # the right number from a failing command
    assert not answer_task.check(workdir, failed, sandbox).solved
    assert answer_task.check(workdir, sandbox.run(f"echo {answer_task.answer}", workdir), sandbox).solved


def test_a_script_that_prints_a_constant_does_not_fix_the_script(sandbox: Sandbox, workdir: Path):
    task = next(t for t in TRAIN if t.rerun is not None)
    task.make(workdir)
    right_now = sum(int(x) for x in (workdir / "numbers.txt").read_text().split())
    sandbox.run(f"echo 'print({right_now})' > total.py", workdir)
    verdict = task.check(workdir, None, sandbox)
    assert not verdict.solved and "on new data" in verdict.why


def test_held_out_tasks_are_never_among_the_train_tasks():
    assert len(TRAIN) == 28 and len(EVAL) == 14
    assert not {t.key for t in TRAIN} & {t.key for t in EVAL}
    assert not {t.files for t in TRAIN} & {t.files for t in EVAL}
    assert {t.family for t in TRAIN} == {t.family for t in EVAL}
    order = task_order(3, 40)
    assert order == task_order(3, 40) and set(order) <= set(TRAIN) and len(set(order)) == len(TRAIN)


def test_the_checker_never_follows_a_link_out_of_the_directory(sandbox: Sandbox, workdir: Path, outside: Path):
    task = next(t for t in TRAIN if t.expected is not None)
    task.make(workdir)
    (workdir / "link").symlink_to(outside)  # as if a command had made it
    files = regular_files(workdir)
    assert files["link"] is None and SECRET.strip() not in "".join(v or "" for v in files.values())
    assert not task.check(workdir, None, sandbox).solved


@pytest.mark.parametrize("attempt", [
    "cat ../{name}", "cd / && ls", "ls /", "cat {path}", "echo changed > {path}", "echo new > /tmp/{name}-new",
    "ln -s {path} link && echo changed > link", "ln -s .. up && cat up/{name}",
    "cp {path} stolen", "python3 -c \"open('{path}', 'w').write('changed')\"",
])
def test_a_command_cannot_leave_its_directory(attempt: str, sandbox: Sandbox, workdir: Path, outside: Path):
    result = sandbox.run(attempt.format(name=outside.name, path=outside), workdir)
    assert outside.read_text() == SECRET
    assert not Path(f"/tmp/{outside.name}-new").exists()
    assert SECRET.strip() not in result.output
    assert all(SECRET.strip() not in (v or "") for v in regular_files(workdir).values())
    if sandbox.backend == "rlimits":
        assert result.refused and result.exit_code is None


def test_the_rlimits_backend_refuses_paths_out_and_lets_regexes_through():
    for command in ("cd / && ls", "cat ../x", "echo a > /tmp/x", "ls ~", "cat //etc/passwd", "ls \"/\"",
                    "python3 -c \"open('/tmp/x', 'w')\""):
        assert escapes(command), command
    for command in ("awk '/ERROR/' f", "sed -i \"s/split(',')/split()/\" total.py", "/usr/bin/wc -l f",
                    "echo 1 2>/dev/null", "ls data/*.log | wc -l", "grep -rl word notes",
                    "grep Kai people.csv | cut -d' ' -f2", "tr ' ' '\\n' < words.txt"):
        assert escapes(command) is None, command


def test_no_network(sandbox: Sandbox, workdir: Path):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    try:
        result = sandbox.run(f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), 3)\"",
                             workdir)
    finally:
        server.close()
    assert result.exit_code not in (0, None), result.text()
    assert "Error" in result.output


def test_the_environment_is_scrubbed(sandbox: Sandbox, workdir: Path, monkeypatch):
    monkeypatch.setenv("CLAWBACK_TEST_SECRET", "hunter2")
    out = sandbox.run("env", workdir).output
    assert "hunter2" not in out and {line.split("=")[0] for line in out.splitlines()} <= {"PATH", "HOME", "LANG", "PWD"}


def _running_with(token: str) -> list[int]:
    """Processes whose command line holds the token (a shell's forks keep its command line)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and token in (proc / "cmdline").read_bytes().decode("utf-8", "replace"):
                found.append(int(proc.name))
        except OSError:
            pass
    return found


def test_a_fork_bomb_and_an_endless_loop_are_stopped(sandbox: Sandbox, workdir: Path, monkeypatch):
    monkeypatch.setattr(sb, "WALL_S", 3.0)  # the limits' behaviour, not their size, is under test
    token = uuid.uuid4().hex
    started = time.monotonic()
    bomb = sandbox.run(f"f() {{ f | f & }}; f; sleep 30 # {token}", workdir)
    assert bomb.timed_out and "Command timed out after 3 seconds." in bomb.text()
    loop = sandbox.run("while :; do :; done", workdir)
    assert loop.timed_out and loop.exit_code is None
    assert time.monotonic() - started < 60
    deadline = time.monotonic() + 10  # nothing the bomb started is left
    while _running_with(token) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _running_with(token) == []


def test_huge_output_is_stopped_and_truncated(sandbox: Sandbox, workdir: Path):
    flood = sandbox.run("yes", workdir)
    assert flood.output_capped and flood.exit_code is None
    assert len(flood.output) <= sb.RESULT_CHARS and flood.text().startswith(sb.RETENTION_NOTE)
    long = sandbox.run("seq 100000", workdir)
    assert long.ok and long.truncated and long.output.endswith("100000\n") and len(long.output) <= sb.RESULT_CHARS
    big = sandbox.run("head -c 5000000 /dev/zero > big", workdir)
    assert big.exit_code != 0 and (workdir / "big").stat().st_size <= sb.FILE_BYTES


def test_results_read_as_openclaws_exec_tool_words_them(sandbox: Sandbox, workdir: Path):
    assert sandbox.run("echo hi", workdir).text() == "hi\n"
    assert sandbox.run("true", workdir).text() == "(no output)"
    assert sandbox.run("echo oops >&2; exit 3", workdir).text() == "oops\n\n\n(Command exited with code 3)"
    missing = sandbox.run("no-such-program", workdir)
    assert missing.exit_code == 127 and missing.text().endswith("\n\nCommand not found")
    assert ExecResult("x", None, "", signal="SIGKILL").text() == "Command aborted by signal SIGKILL"


def test_a_daemon_without_outcome_events_stops_the_run_with_a_clear_error():
    """A stand-in for a daemon that predates outcome events (httpx.MockTransport answering as the
    feedback route answers an unknown kind); the real route is exercised by the slow smoke."""
    sent = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(400, json={"type": "error", "code": "malformed",
                                         "message": "kind: Input should be 'thumbs_up', 'thumbs_down', ..."})

    async def send() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://daemon") as client:
            await send_outcome(client, "s1", Verdict(False, "the last command failed"))

    with pytest.raises(SimError, match="needs a daemon that takes outcome events"):
        asyncio.run(send())
    body = json.loads(sent[0].content)
    assert body["kind"] == "outcome" and body["session_id"] == "s1" and body["reward"] == -1.0
    assert body["text"] == "the last command failed" and body["source"] == "simulator"


def test_a_call_of_a_tool_that_is_not_exec_is_answered_as_openclaw_does_and_the_policy_may_retry():
    """The episode loop with a scripted policy (httpx.MockTransport answering as the daemon's chat
    route would) so that its replies are fixed: a call of an invented tool runs nothing and comes
    back as "Tool count_logs not found"; the next call of `exec` runs and solves the task."""
    task = TRAIN[0]
    replies = [{"name": "count_logs", "arguments": {"command": task.solution}},
               {"name": "exec", "arguments": {"command": task.solution}}, None]
    seen: list[list[dict]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content)["messages"])
        call = replies[len(seen) - 1]
        message = ({"role": "assistant", "content": "Done."} if call is None else
                   {"role": "assistant", "content": None, "tool_calls": [{"id": f"call_{len(seen)}", "type": "function",
                    "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}}]})
        return httpx.Response(200, json={"choices": [{"message": message, "finish_reason": "stop"}]})

    async def episode():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://daemon") as client:
            return await run_episode(client, Sandbox("rlimits"), task, lambda k: {})

    ep = asyncio.run(episode())
    assert [c["command"] for c in ep.commands] == [None, task.solution]
    assert seen[1][-1] == {"role": "tool", "tool_call_id": "call_1", "content": "Tool count_logs not found"}
    assert ep.verdict is not None and ep.verdict.solved, ep.verdict
