"""The gate's rules without a model: probe checks, collapse statistics, training health, the
held-out share and the live guard's test."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from clawback.daemon.config import GateConfig, Settings
from clawback.daemon.gate import health_reasons, held_out
from clawback.daemon.guard import fisher_greater
from clawback.daemon.probes import (
    NOT_ON_OWN_REQUESTS,
    REFUSAL_REPLY,
    CollapseStats,
    Generation,
    against_live_and_base,
    collapse_reasons,
    collapse_stats,
    load_probes,
    passes,
)
from clawback.daemon.store.queries import HealthPoint


def test_the_probe_set_covers_every_kind_and_each_check_can_pass_and_fail():
    probes = {p.id: p for p in load_probes()}
    assert len(probes) >= 50
    assert {p.kind for p in probes.values()} == {"arithmetic", "fact", "format", "tool_call"}
    cases = {
        "arithmetic-02": ("7 + 5 = 12.", "7 + 5 = 13"),  # 12
        "fact-01": ("The capital of France is Paris.", "It is Lyon, not Parisian."),
        "format-01": ("YES", "Yes, I can reply with yes."),
        "format-04": ("- red\n- blue\n- green", "red, blue, green"),
        "format-05": ('```json\n{"name": "Ada"}\n```', '{"name": "Bob"}'),
        "format-07": ("[1, 2, 3]", "[1, 2]"),
        "tool_call-01": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
                         '<tool_call>\n{"name": "get_weather", "arguments": {"town": "Paris"}}\n</tool_call>'),
        "tool_call-03": ('<tool_call>{"name": "set_timer", "arguments": {"minutes": 10}}</tool_call>',
                         '<tool_call>{"name": "set_timer", "arguments": {"minutes": "10"}}</tool_call>'),
    }
    for pid, (good, bad) in cases.items():
        assert passes(probes[pid], good), (pid, good)
        assert not passes(probes[pid], bad), (pid, bad)


def gen(text: str, n: int = 10, logprob: float = -1.0, finish: str = "stop") -> Generation:
    return Generation(list(range(n)), [logprob] * n, text, finish)


VARIED = [gen(t) for t in ("The capital of France is Paris.", "7 + 5 = 12", "Bees make honey in their hives.",
                           "Here are three colors: red, blue and green.", "A spider has eight legs and spins webs.")]


def test_collapse_detectors_fire_for_the_right_reason():
    cfg = GateConfig()
    live = collapse_stats(VARIED)
    assert collapse_reasons(live, live, cfg, "v1") == []
    same = collapse_stats([gen("I love bananas so much, bananas are great.", logprob=-0.01)] * 5)
    reasons = collapse_reasons(same, live, cfg, "v1")
    assert any("same reply to different prompts" in r for r in reasons)
    assert any("token entropy" in r for r in reasons)
    looping = collapse_stats([gen("ok ok ok ok ok ok ok ok ok ok ok ok", n=32, finish="length")] * 5)
    assert any("repetition" in r for r in collapse_reasons(looping, live, cfg, "v1"))
    assert any("cut-off" in r for r in collapse_reasons(looping, live, cfg, "v1"))
    empty = collapse_stats([gen("", n=0)] * 5)
    assert any("empty replies" in r for r in collapse_reasons(empty, live, cfg, "v1"))
    meta = collapse_stats([gen("I'm sorry for the confusion. " + g.text) for g in VARIED])
    assert [r for r in collapse_reasons(meta, live, cfg, "v1") if "about the conversation" in r]
    long = collapse_stats([gen(g.text + " and so on", n=60) for g in VARIED])
    assert any("reply length 60 vs 10" in r for r in collapse_reasons(long, live, cfg, "v1"))


def test_replies_that_decline_the_task_are_refused_against_live_and_base():
    """The drift seen in the simulator: answers turn into "as a chatbot, I don't have the
    capability to…". Ordinary answers that mention what they cannot know do not count."""
    cfg = GateConfig()
    declining = [gen(t) for t in (
        "I'm sorry for the misunderstanding, but as a chatbot designed to assist with homework, I don't have the "
        "capability to assist with homework.",
        "As an AI, I'm not able to browse the internet.", "I'm unable to assist with your homework.",
        "I cannot help with that request.", "I am not equipped to provide data about real-world scenarios.")]
    assert all(REFUSAL_REPLY.search(g.text) for g in declining)
    fine = ["The train covers 120 km, so it can't be late.", "I can help: 3 + 4 = 7.",
            "Without the price we do not know the total.", "As a result, 6 apples are left."]
    assert not any(REFUSAL_REPLY.search(t) for t in fine)
    answers = VARIED + VARIED

    def declines(n: int) -> CollapseStats:
        return collapse_stats(declining[1:1 + n] + answers[n:])

    base, live, cand = declines(0), declines(2), declines(3)
    assert cand.refusal_rate == 0.3 and base.refusal_rate == 0.0
    assert collapse_reasons(cand, base, cfg, "v1") == ["collapse: replies that decline the task 30% vs 0% on v1"]
    assert collapse_reasons(cand, live, cfg, "v2") == []  # 30% vs 20%: within refusal_rise of live
    assert against_live_and_base(cand, live, base, cfg, "v2") == [
        "collapse: replies that decline the task 30% vs 0% on base"]


def test_a_length_the_person_asked_for_is_no_collapse_on_their_own_requests():
    """A person who asked for short replies gets them: on their own requests the length shift is
    not a reason; on the probes it still is, and a loop on their requests still is."""
    cfg = GateConfig()
    wordy = collapse_stats([gen(g.text + " and so on", n=60) for g in VARIED])
    brief = collapse_stats(VARIED)  # 10 tokens against 60
    assert any("reply length 10 vs 60" in r for r in against_live_and_base(brief, wordy, wordy, cfg, "v1"))
    assert against_live_and_base(brief, wordy, wordy, cfg, "v1", "your requests", NOT_ON_OWN_REQUESTS) == []
    looping = collapse_stats([gen("ok ok ok ok ok ok ok ok ok ok ok ok", n=32, finish="length")] * 5)
    own = against_live_and_base(looping, wordy, wordy, cfg, "v1", "your requests", NOT_ON_OWN_REQUESTS)
    assert any("collapse (your requests): cut-off" in r for r in own)


def test_what_nobody_wants_cannot_creep_up_version_by_version():
    """Each version apologises a little more than the last: every step passes against live, the
    drift shows against the base model."""
    cfg = GateConfig()
    replies = VARIED + [gen(t) for t in ("Water boils at 100 degrees.", "Nine is an odd number.", "Owls hunt at night.",
                                         "Rome is in Italy.", "A triangle has three sides.")]

    def sorry(n: int) -> dict[str, float]:
        return collapse_stats([gen("I'm sorry for the confusion. " + g.text) if i < n else g for i, g in enumerate(replies)])

    base, live, cand = sorry(0), sorry(2), sorry(3)
    assert collapse_reasons(cand, live, cfg, "v2") == []  # 30% vs 20%: within meta_rise of live
    reasons = against_live_and_base(cand, live, base, cfg, "v2", "your requests")
    assert reasons == ["collapse (your requests): replies about the conversation 30% vs 0% on base"]
    # Length is not held to the base model: a person may ask for longer replies.
    longer = collapse_stats([gen(g.text + " and so on", n=60) for g in VARIED])
    assert against_live_and_base(longer, longer, base, cfg, "v2") == []
    assert against_live_and_base(cand, base, None, cfg, None) == collapse_reasons(cand, base, cfg, "base")


def test_training_health():
    cfg = GateConfig()
    history = [HealthPoint(loss=0.1 * (-1) ** i, grad_norm=2.0 + 0.1 * i) for i in range(5)]
    assert health_reasons({"loss": 0.2, "grad_norm": 3.0}, history, cfg) == []
    assert health_reasons({"loss": math.nan, "grad_norm": 3.0}, history, cfg) == ["training health: non-finite loss"]
    assert "gradient norm 556" in health_reasons({"loss": 0.2, "grad_norm": 556.0}, history, cfg)[0]
    assert "loss 40" in health_reasons({"loss": 40.0, "grad_norm": 3.0}, history, cfg)[0]
    assert health_reasons({"loss": 40.0, "grad_norm": 556.0}, history[:2], cfg) == []  # too little history


def test_held_out_share_is_stable_and_near_the_setting():
    calls = [([1, 2, i % 40], [i // 40, 7]) for i in range(2000)]
    share = sum(held_out(p, r, 0.2) for p, r in calls) / len(calls)
    assert 0.17 < share < 0.23
    assert [held_out(p, r, 0.2) for p, r in calls[:50]] == [held_out(list(p), list(r), 0.2) for p, r in calls[:50]]
    assert not any(held_out(p, r, 0.0) for p, r in calls)
    # The same prompt with another reply is chosen afresh: a recurring request still trains.
    assert len({held_out([5, 5], [i], 0.5) for i in range(20)}) == 2


def test_fisher_one_sided_exact_test():
    assert fisher_greater(3, 3, 0, 3) == pytest.approx(1 / 20)  # C(6,3) = 20 equally likely tables
    assert fisher_greater(0, 20, 5, 20) == pytest.approx(1.0)
    # scipy.stats.fisher_exact([[7, 13], [1, 19]], alternative="greater").pvalue
    assert fisher_greater(7, 20, 1, 20) == pytest.approx(0.0217980217980218)
    assert fisher_greater(3, 20, 2, 40) > 0.05  # a small difference on small counts is not a rise


def test_gate_settings_live_in_a_gate_table(tmp_path):
    (tmp_path / "clawback.toml").write_text("[gate]\nretention_margin = 5\nguard_replies = 0\n")
    s = Settings(data_dir=tmp_path)
    assert s.gate.retention_margin == 5 and s.gate.guard_replies == 0 and s.gate.enabled
    with pytest.raises(ValueError):
        Settings(data_dir=tmp_path, gate={"retention_margn": 1})


def test_only_rated_calls_are_held_out():
    from clawback.daemon.gate import CandidateGate
    from clawback.records import ReadySample

    gate = CandidateGate(None, None, None, GateConfig(held_out_share=0.5))  # type: ignore[arg-type]

    def sample(i: int, source: str, correction: str | None = None) -> ReadySample:
        return ReadySample(f"call-{i}", 1.0, None, [1, i], [2], [-1.0], None, reward_source=source, correction=correction)

    rated = [gate.holds_out(sample(i, "explicit")) for i in range(200)]
    assert 70 < sum(rated) < 130
    assert [gate.holds_out(sample(i, "judge", "shorter")) for i in range(200)] == rated  # a correction is a rating
    assert not any(gate.holds_out(sample(i, "judge")) for i in range(200))  # the judge's verdicts all train
    # A sample trained in another prompt (note consolidation) is held out as the call it was served as.
    consolidated = [ReadySample(f"call-{i}", 1.0, None, [7, 7, i], [2], [-1.0], None, reward_source="explicit",
                                served_prompt_ids=[1, i]) for i in range(200)]
    assert [gate.holds_out(s) for s in consolidated] == rated


def test_retention_is_a_paired_exact_test_on_the_changed_probes():
    from clawback.daemon.gate import retention_test

    assert retention_test(["a", "b"], ["a", "b"]) == (0, 0, 1.0)  # nothing changed: never refused
    # Three probes lost, none gained: 1/8, which is chance at 56 probes, not forgetting.
    assert retention_test([], ["a", "b", "c"]) == (3, 0, 0.125)
    lost, gained, p = retention_test(["x"], ["a", "b", "c", "d", "e"])  # 5 lost, 1 gained
    assert (lost, gained) == (5, 1) and abs(p - 7 / 64) < 1e-12
    assert retention_test([], list("abcde"))[2] == 1 / 32 < 0.05  # 5 lost, none gained: refused
    # Many probes changing both ways is churn, not loss.
    assert retention_test(list("abcdefgh"), list("ijklmnopq"))[2] > 0.4


def test_a_rise_by_the_limit_counts_and_loops_are_a_detector():
    from clawback.daemon.probes import ends_in_loop

    cfg = GateConfig()
    live = collapse_stats([Generation([1, 2, 3], [-1.0] * 3, "fine", "stop")] * 4)
    cut = [Generation([1, 2, 3], [-1.0] * 3, "a", "length")] * 3 + [Generation([1, 2, 3], [-1.0] * 3, "b", "stop")]
    cand = collapse_stats(cut[:2] + [Generation([1, 2, 3], [-1.0] * 3, "b", "stop")] * 2)  # 50% cut vs 0%
    assert any("cut-off replies 50%" in r for r in collapse_reasons(cand, live, cfg, "v1"))
    two_of_four = replace(live, cut_rate=0.75)
    assert any("cut-off replies 75% vs 50%" in r for r in collapse_reasons(two_of_four, replace(live, cut_rate=0.5), cfg, "v1"))
    loop = list(range(8)) + [7, 9] * 20
    assert ends_in_loop(loop) and not ends_in_loop(list(range(40))) and not ends_in_loop([7, 9] * 10)  # too short
    looping = collapse_stats([Generation(loop, [-1.0] * len(loop), "x y " * 20, "length")] + [Generation([1], [-1.0], "ok", "stop")] * 3)
    assert looping.loop_rate == 0.25
    assert any("looping replies 25% vs 0%" in r for r in collapse_reasons(looping, live, cfg, "v1"))


def test_a_reply_that_says_a_sentence_twice_is_a_detector_held_to_the_base_too():
    from clawback.replies import repeats_a_sentence

    # Replies of a trained Qwen2.5-Coder-0.5B version to its person's homework tasks (64 tokens:
    # none ends in a loop yet), against the base model's.
    stutter = ["Great question! Great question! The gardener can plant 13 full pots.",
               "Great question! Let's multiply: 17 × 3 = 51 kg. Great question! Let's multiply"]
    fine = ["Great question! 17 bags of 3 kg each weigh 17 × 3 = 51 kg.",
            "1. Count the hens.\n2. Multiply by 5.\n\n1. 11 hens.\n2. 55 eggs.",  # item numbers are no sentence
            "```python\nx = 1\nprint(x)\nx = 1\nprint(x)\n```\nIt prints 1 twice.",  # code repeats on purpose
            "The price is $2.50. The total is $2.505."]
    assert all(map(repeats_a_sentence, stutter)) and not any(map(repeats_a_sentence, fine))
    cfg = GateConfig()
    base = collapse_stats([gen(t) for t in fine])
    cand = collapse_stats([gen(t) for t in stutter + fine[:2]])
    assert (cand.repeat_rate, cand.loop_rate, base.repeat_rate) == (0.5, 0.0, 0.0)
    reasons = against_live_and_base(cand, replace(base, repeat_rate=0.25), base, cfg, "v3", "your requests",
                                    NOT_ON_OWN_REQUESTS)
    # 50% vs 25% on live is a rise by the limit or more, and against the base as well.
    assert reasons == ["collapse (your requests): replies that repeat a sentence 50% vs 25% on v3",
                       "collapse (your requests): replies that repeat a sentence 50% vs 0% on base"]


EXEC = {"type": "function", "function": {"name": "exec", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}


def test_a_version_whose_tool_calls_stop_working_is_refused_on_the_persons_requests():
    # Replies to shell tasks offering `exec`, as Qwen2.5-Coder-0.5B wrote them before and after
    # training on failed outcomes: the trained versions invent tools and pass the command as a string.
    working = ['<tool_call>\n{"name": "exec", "arguments": {"command": "wc -l maple_4.txt"}}\n</tool_call>',
               '{"name": "exec", "arguments": {"command": "ls data | wc -l"}}',  # bare JSON: serving reads it too
               "The file has 43 lines.",  # the answer after a tool result: no call, and none needed
               '{"name": "count_logs", "arguments": {"command": "ls data/*.log"}}']
    broken = ['{"name": "exec", "arguments": "wc -l maple_4.txt"}', '{"name": "count_logs", "arguments": "data"}',
              "The file has 43 lines.", '{"name": "printCity", "arguments": "people.csv"}']
    offered = [[EXEC]] * 4
    live, cand = collapse_stats([gen(t) for t in working], offered), collapse_stats([gen(t) for t in broken], offered)
    assert (live.no_working_call_rate, cand.no_working_call_rate) == (0.5, 1.0)
    cfg = GateConfig()
    reasons = against_live_and_base(cand, live, live, cfg, "v1", "your requests", NOT_ON_OWN_REQUESTS)
    assert reasons == ["collapse (your requests): replies with no tool call that could run 100% vs 50% on v1",
                       "collapse (your requests): replies with no tool call that could run 100% vs 50% on base"]
    # Only replies to requests that offered tools count; without any, nothing is measured.
    assert collapse_stats([gen(t) for t in broken]).no_working_call_rate == 0.0
    assert collapse_stats([gen(t) for t in broken], [[EXEC], [], [], []]).no_working_call_rate == 1.0
    # A call of a tool the request did not offer is no working call, whatever its name.
    assert collapse_stats([gen(working[0])], [[replace_name(EXEC, "run")]]).no_working_call_rate == 1.0
    # One reply of four is a step of 25%: the limit counts (≥), a smaller step does not.
    one_fewer = collapse_stats([gen(t) for t in [*working[:1], broken[0], *working[2:]]], offered)
    assert against_live_and_base(one_fewer, live, live, cfg, "v1") != []
    assert against_live_and_base(one_fewer, live, live, GateConfig(tool_call_drop=0.3), "v1") == []


def replace_name(tool: dict, name: str) -> dict:
    return {**tool, "function": {**tool["function"], "name": name}}
