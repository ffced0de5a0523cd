"""Methods as bundles of settings, and the aggregation over seeds."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import pytest

from clawback.daemon.config import Settings
from clawback.sim.cell_file import (
    CellRecord,
    CodeStamp,
    CurvePoint,
    Interaction,
    MemoryNote,
    NoteCheck,
    ProbePoint,
    SimConfigFields,
    TrainStepRow,
    Versions,
)
from clawback.sim.config import METHODS, SimConfig, parse_methods
from clawback.sim.harness import Cell
from clawback.sim.results import (
    adapt_order,
    all_cells,
    markdown_table,
    mean_ci,
    read_cell,
    sessions_to_adapt,
    sign_test,
    stamp_of,
    step_curve,
    summarize,
    t975,
)


def test_seed_is_the_daemons_seed_preset():
    cfg = SimConfig(lr=3e-4, batch_size=8)
    s = Settings(**cfg.settings_for(METHODS["seed"], seed=2), no_auth=True)
    sig = s.signal_config()
    assert (sig.method, sig.teacher, sig.judge_context, sig.count_zero_signal, s.judge.backend) == (
        "combined", "base", "response_only", True, "off")
    tc = s.train_config()
    assert (tc.method, tc.tis_cap, tc.lr, tc.weight_decay, tc.betas, tc.batch_size, tc.seed) == (
        "combined", None, 1e-5, 0.1, (0.9, 0.98), 8, 2)
    assert tc.opd_top_k == 0 and sig.hint_template == "hint"  # the original recipe: sampled token, its wording
    combined = Settings(**cfg.settings_for(METHODS["combined"], seed=2), no_auth=True)
    assert (combined.train_config().lr, combined.train_config().tis_cap) == (3e-4, 2.0)
    assert (combined.train_config().opd_top_k, combined.train_config().opd_clip) == (4, 1.0)
    assert combined.signal_config().teacher == "self" and combined.train.enabled and not combined.memory
    assert combined.signal_config().hint_template == "hint" and combined.memory_placement == "user"
    consolidated = Settings(**cfg.settings_for(METHODS["default_consolidated"], seed=2), no_auth=True)
    assert consolidated.memory and consolidated.signal_config().consolidate_notes
    assert not Settings(**cfg.settings_for(METHODS["default"], seed=2), no_auth=True).signal_config().consolidate_notes
    none = Settings(**cfg.settings_for(METHODS["none"], seed=2), no_auth=True)
    assert not METHODS["none"].trains and not none.train.enabled and not none.memory
    kl = Settings(**SimConfig(kl_coef=0.05).settings_for(METHODS["binary"], seed=1), no_auth=True)
    assert kl.train_config().kl_coef == 0.05
    evidence = Settings(**cfg.settings_for(METHODS["opd_evidence"], seed=1), no_auth=True)
    assert evidence.train_config().evidence_weight == 1.0 and evidence.signal_config().positive_evidence
    assert Settings(**cfg.settings_for(METHODS["opd_token"], seed=1), no_auth=True).train_config().opd_top_k == 0
    memory = Settings(**cfg.settings_for(METHODS["memory"], seed=1), no_auth=True)
    assert memory.memory and not memory.train.enabled
    default = Settings(**cfg.settings_for(METHODS["default"], seed=1), no_auth=True)
    assert default.memory and default.train.enabled and default.train_config().method == "combined"
    assert default.gate.enabled and default.gate.guard_replies > 0
    default_evidence = Settings(**cfg.settings_for(METHODS["default_evidence"], seed=1), no_auth=True)
    assert default_evidence.memory and default_evidence.train_config().method == "combined"
    assert default_evidence.train_config().evidence_weight == 1.0 and default_evidence.signal_config().positive_evidence
    assert not default.signal_config().train_loops
    loops = Settings(**cfg.settings_for(METHODS["default_loops"], seed=1), no_auth=True)
    assert loops.memory and loops.train_config().loop_penalty == 1.0 and loops.signal_config().train_loops
    updates = Settings(**cfg.settings_for(METHODS["default_updates"], seed=1), no_auth=True)
    assert updates.memory and updates.train_config().updates_per_batch == 4 and default.train_config().updates_per_batch == 1
    corrections = Settings(**cfg.settings_for(METHODS["binary_corrections"], seed=1), no_auth=True)
    assert corrections.signal_config().correction_reward == -1.0 and default.signal_config().correction_reward == 0.0
    ungated = Settings(**cfg.settings_for(METHODS["default_ungated"], seed=1), no_auth=True)
    assert ungated.memory and ungated.train_config().method == "combined"
    assert not ungated.gate.enabled and ungated.gate.guard_replies == 0


def test_method_lists():
    assert parse_methods("all") == ("none", "default", "memory", "default_evidence", "default_loops",
                                     "default_updates", "binary", "binary_corrections", "opd",
                                     "opd_token",
                                     "opd_evidence",
                                     "combined", "default_ungated", "default_consolidated", "default_consolidated_updates",
                                     "default_consolidated_evidence",
                                     "combined_ungated",
                                     "seed")
    assert parse_methods("combined, binary,combined") == ("combined", "binary")
    with pytest.raises(ValueError, match="unknown method"):
        parse_methods("")
    with pytest.raises(ValueError):
        SimConfig(interactions=0)


def test_step_curve_and_interval():
    curve = [(3, 0.5), (0, 0.2), (5, 0.4)]
    assert step_curve(curve, 6) == [0.2, 0.2, 0.2, 0.5, 0.5, 0.4, 0.4]
    m, lo, hi = mean_ci([0.4, 0.5, 0.6])
    assert m == pytest.approx(0.5) and hi - m == pytest.approx(4.303 * 0.1 / math.sqrt(3))
    assert math.isnan(mean_ci([0.3])[1])


def test_t_quantile_takes_n_minus_1_degrees_of_freedom():
    assert t975(11) == 2.201 and t975(5) == 2.571  # 12 and 6 paired seeds
    assert t975(35) == t975(30) == 2.042  # between listed ones: the smaller df's, never narrower
    twelve = [0.1 * (i % 3) for i in range(12)]
    m, lo, hi = mean_ci(twelve)
    assert hi - m == pytest.approx(2.201 * statistics.stdev(twelve) / math.sqrt(12))


def test_sessions_to_adaptation_is_adaptation_that_lasts():
    # From session 2 on, every window of 4 holds 3 that meet (2-5, 3-6, 4-7, 5-8); 1-4 holds 2.
    assert sessions_to_adapt([False, True, True, False, True, True, True, False]) == 2
    assert sessions_to_adapt([False, False, False, True, True, True, True]) == 3
    assert sessions_to_adapt([True] * 4) == 1
    # A first 3-in-a-row that does not last is not adaptation.
    assert sessions_to_adapt([False, False, True, True, True, False, False, False, True, False, False, False]) is None
    assert sessions_to_adapt([True, True, True]) is None  # shorter than one window: cannot tell
    assert sessions_to_adapt([True, True, False] * 10) is None  # capped: not adapted, never a number
    order = adapt_order({1: 3, 2: None, 3: None, 4: 5, 5: 2}, {1: 5, 2: None, 3: 4, 4: 5})
    assert order == {"seeds": [1, 2, 3, 4], "sooner": 1, "same": 1, "later": 1, "neither": 1, "sign_p": 1.0}
    # All one way: 5 seeds are not enough (p = 2/32), 6 are (2/64); one seed against halves nothing.
    assert sign_test(5, 0) == pytest.approx(0.0625) and sign_test(0, 6) == pytest.approx(0.03125)
    assert sign_test(6, 1) == pytest.approx(16 / 128) and sign_test(0, 0) == 1.0


def _cell(method: str, seed: int, meets: list[bool], stamp: str = "abc", score: float = 0.5,
          gates: dict[int, str] | None = None, right: dict[int, bool] | None = None) -> dict:
    return {"cell": {"scenario": "sure", "method": method, "seed": seed}, "config": {"interactions": len(meets)},
            "code": {"stamp": stamp, "commit": "c0ffee"}, "finished_at": f"2026-11-30T2{seed}:00:00Z",
            "curve": [{"interaction": 0, "score": 0.1}, {"interaction": len(meets), "score": score}],
            "probe": [{"interaction": 0, "mass": 0.0}], "interactions": [{"meets": m, "gate": (gates or {}).get(i), "right": (right or {}).get(i, True),
                              "reply": "Sure! 2 x 3 = 6."} for i, m in enumerate(meets)],
            "steps": [], "wall_s": 60.0}


def test_paired_differences_and_code_stamps_never_mix():
    no, yes = [False] * 6, [True] * 6
    cells = [_cell("default", 1, [False, True, True, True, True, True], score=0.9),
             _cell("default", 2, [False, False, True, True, True, False], score=0.7, right={0: False, 1: False}),
             _cell("memory", 1, [False, False, False, True, True, True], score=0.5),
             _cell("memory", 2, no, score=0.5, gates={0: "cut", 1: "meta", 2: "cut"}),
             {**_cell("memory", 3, yes, stamp="old"), "finished_at": "2026-11-29T10:00:00Z"}]
    s = summarize(cells)  # the newest cell's code; the older code's cell is excluded, not mixed in
    assert s["code_stamp"] == "abc" and s["excluded_other_code"] == ["sure/memory/seed3 (old)"]
    assert s["scenarios"]["sure"]["memory"]["sessions_to_adapt"] == {"1": 3, "2": None}
    assert s["scenarios"]["sure"]["memory"]["adapted"] == "1/2"
    assert s["scenarios"]["sure"]["memory"]["meets_by_session"] == [0, 0, 0, 0.5, 0.5, 0.5]
    d = s["paired"]["sure"]["default - memory"]
    assert d["sessions_to_adapt"]["seeds"] == [1] and d["sessions_to_adapt"]["diffs"] == [-2.0]
    # Seed 1: 1 before 3; seed 2: default adapted at 2, memory never (an order, not a number).
    assert {k: d["adapt_order"][k] for k in ("sooner", "same", "later", "neither")} == \
        {"sooner": 2, "same": 0, "later": 0, "neither": 0}
    assert d["final_score"]["diffs"] == pytest.approx([0.4, 0.2])
    # Memory's seed 2 had 3 of 6 replies cut off or about the conversation, default none.
    assert s["scenarios"]["sure"]["memory"]["broken_rate"][0] == pytest.approx(0.25)
    assert d["broken_rate"]["diffs"] == pytest.approx([0.0, -0.5])
    # Correctness counts right answers in any form: default's seed 2 got 2 of 6 wrong.
    assert s["scenarios"]["sure"]["default"]["right_rate"][0] == pytest.approx((1 + 4 / 6) / 2)
    assert d["right_rate"]["diffs"] == pytest.approx([0, -2 / 6])
    assert s["scenarios"]["sure"]["default"]["meets_last"][0] == pytest.approx((5 / 6 + 3 / 6) / 2)
    long = [_cell("default", 1, [False] * 8 + [True] * 8), _cell("memory", 1, [True] * 8 + [False] * 8)]
    last = summarize(long)["paired"]["sure"]["default - memory"]["meets_last"]
    assert last["diffs"] == [1.0]  # the last 8 sessions, not the run
    old = summarize([{**c, "interactions": [{k: v for k, v in i.items() if k != "right"} for i in c["interactions"]]}
                     for c in long])  # recorded before answers were checked: correctness unknown
    assert old["scenarios"]["sure"]["default"]["right_rate"] is None
    # The probe compares the last one of each run: an older memory cell probed only at the start
    # (no notes yet) and the end, a default cell on every version, alike until the end.
    probes = {("default", 1): [(0, 0.0), (2, 0.6), (6, 0.6)], ("memory", 1): [(0, 0.0), (6, 0.5)]}
    probed = [{**c, "probe": [{"interaction": i, "mass": x} for i, x in probes[(c["cell"]["method"], c["cell"]["seed"])]]}
              for c in cells if (c["cell"]["method"], c["cell"]["seed"]) in probes]
    assert summarize(probed)["paired"]["sure"]["default - memory"]["probe_final"]["diffs"] == pytest.approx([0.1])
    assert summarize(probed)["paired"]["sure"]["default - memory"]["probe_off_gain"] is None  # recorded before it
    # Without the notes: the last probe less the base's, per seed; memory's weights never move.
    off = {("default", 1): [(0, 0.1, 0.1), (6, 0.6, 0.3)], ("memory", 1): [(0, 0.1, 0.1), (6, 0.5, 0.1)]}
    probed_off = [{**c, "probe": [{"interaction": i, "mass": x, "mass_off": y} for i, x, y in off[(c["cell"]["method"], 1)]]}
                  for c in cells if (c["cell"]["method"], c["cell"]["seed"]) in off]
    s_off = summarize(probed_off)
    assert s_off["scenarios"]["sure"]["default"]["probe_off_gain"][0] == pytest.approx(0.2)
    assert s_off["paired"]["sure"]["default - memory"]["probe_off_gain"]["diffs"] == pytest.approx([0.2])
    m, lo, hi = mean_ci([0.4, 0.2])
    assert (d["final_score"]["low"], d["final_score"]["high"]) == (pytest.approx(lo), pytest.approx(hi))
    table = markdown_table(s)
    assert "not adapted" in table and "default − memory" not in table and "default - memory" in table
    assert "| sure | default - memory | adapted sooner / same / later / neither | 1,2 | 2 / 0 / 0 / 0 | sign test p = 0.5 |" in table


def test_held_out_gain_with_the_notes_off_is_paired_per_seed():
    """What the weights alone kept: the notes-off held-out rates at the last evaluation minus the
    first (the base), per seed; cells recorded without them are left out, never read as 0."""
    def with_off(c: dict, off: tuple[float, float], right: tuple[float, float]) -> dict:
        first, last = c["curve"]
        return {**c, "curve": [{**first, "meets": 0.1, "right": 0.8, "meets_off": off[0], "right_off": right[0]},
                               {**last, "meets": 0.9, "right": 0.8, "meets_off": off[1], "right_off": right[1]}]}

    cells = [with_off(_cell("default", 1, [True] * 4), (0.0, 0.5), (0.8, 0.7)),
             with_off(_cell("default", 2, [True] * 4), (0.1, 0.3), (0.9, 0.9)),
             with_off(_cell("memory", 1, [True] * 4), (0.0, 0.0), (0.8, 0.8)),
             _cell("memory", 2, [True] * 4)]  # an older cell: no notes-off evaluation
    s = summarize(cells)
    default = s["scenarios"]["sure"]["default"]
    assert default["meets_off_gain"][0] == pytest.approx(0.35)
    assert default["right_off_gain"][0] == pytest.approx(-0.05)
    assert default["meets_off_before_after"][0][0] == pytest.approx(0.05)
    assert default["meets_off_before_after"][1][0] == pytest.approx(0.4)
    assert s["scenarios"]["sure"]["memory"]["meets_off_gain"][0] == 0.0
    d = s["paired"]["sure"]["default - memory"]["meets_off_gain"]
    assert d["seeds"] == [1] and d["diffs"] == pytest.approx([0.5])
    table = markdown_table(s)
    assert "| sure | default | 0.10 → 0.90 | 0.80 → 0.80 | 0.05 → 0.40 | 0.85 → 0.80 | +0.350" in table
    assert "| sure | memory | 0.10 → 0.90 | 0.80 → 0.80 | 0.00 → 0.00 | 0.80 → 0.80 | +0.000 |" in table


def _has_keys(value: object, record: type) -> bool:
    """Every key the TypedDict `record` requires is in the dict `value`."""
    return isinstance(value, dict) and record.__required_keys__ <= value.keys()


def test_a_committed_cell_reads_through_the_cell_files_types():
    out = Path(__file__).resolve().parents[2] / "bench" / "results" / "cons"
    cell = Cell("sure", "default", 1)
    record = read_cell(out, cell)
    assert record is not None and _has_keys(record, CellRecord)
    assert record["cell"] == {"scenario": "sure", "method": "default", "seed": 1}
    assert all(_has_keys(p, CurvePoint) for p in record["curve"])
    assert all(_has_keys(p, ProbePoint) for p in record.get("probe", []))
    assert all(_has_keys(i, Interaction) for i in record["interactions"])
    assert all(_has_keys(s, TrainStepRow) for s in record["steps"])
    assert _has_keys(record["config"], SimConfigFields) and _has_keys(record.get("code"), CodeStamp)
    assert _has_keys(record.get("versions"), Versions)
    assert all(_has_keys(n, MemoryNote) for n in record.get("memory_notes", []))
    assert all(_has_keys(c, NoteCheck) for c in record.get("memory_checks", []))
    summary = summarize(all_cells(out))
    row = summary["scenarios"]["sure"]["default"]
    assert 1 in row["seeds"] and row["interactions"] == record["config"]["interactions"]
    assert summary["code_stamp"] == stamp_of(record)
