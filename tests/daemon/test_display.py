"""What the CLI says to people (`clawback status`, `forget`, `adapters`), from the daemon's JSON."""

from __future__ import annotations

from clawback.daemon.display import adapters_text, forget_text, reward_origin, sample_state, status_text, table

STATUS = {
    "daemon": "running", "version": "0.1.0", "model": "SmolLM2-135M-Instruct", "served_model_name": "clawback",
    "context_length": 8192, "adapter_version": "v2", "uptime_s": 3725.0, "sessions_open": 2,
    "signals": {"method": "combined", "teacher": "self", "judge": "off", "feedback_connections": 1},
    "training": {"enabled": True, "batch_size": 16, "samples_ready": 3, "training_now": False, "last_step": None},
    "memory": {"enabled": True, "notes": [{"note_id": 1, "text": "Be brief.", "active": True, "retired_by": None}]},
    "gate": {"enabled": True, "promoted": 2, "refused": 1, "newest": {"version": 3, "state": "refused", "reason": "collapse"}},
    "store": {"path": "/data/clawback.db", "calls": {"main/paired": 1, "main/awaiting_next_state": 37, "side/closed": 4},
              "samples": {"ready": 3, "pending_judge": 1, "dropped": 3}, "feedback": {"applied": 4, "orphan": 1},
              "dropped_samples": {"cut_off": 2, "held_out": 1}},
}


def test_status_for_people_says_what_waits_and_why_samples_were_not_trained_on():
    text = status_text(STATUS, "http://127.0.0.1:30100")
    assert text.splitlines()[0] == "daemon: running at http://127.0.0.1:30100 for 1 h 2 min (clawback 0.1.0)"
    assert "serving v2" in text
    assert "main calls: 38 (1 paired with a next state, 37 waiting for one); side calls: 4; sessions open: 2" in text
    assert "samples: 3 of 16 ready for the next training step; 1 waiting for the judge" in text
    assert "  2 dropped: the reply was cut off by its token limit (max_tokens) before it ended" in text
    assert "  1 held out: held out for the gate" in text
    assert "gate: 2 promoted, 1 refused; newest v3 refused: collapse" in text
    offline = status_text({"daemon": "not reachable at http://127.0.0.1:30100 (ConnectError)", "store": STATUS["store"]},
                          "http://127.0.0.1:30100")
    assert offline.startswith("daemon: not reachable") and "main calls: 38" in offline


def test_forget_and_adapters_in_words():
    said = forget_text({"scope": "session", "sessions": 1, "deleted": {"calls": 2, "feedback_events": 1, "votes": 0},
                        "affected_versions": [1, 2], "rollback_to": None})
    assert said.splitlines()[0] == "forgot 1 session: 2 calls, 1 feedback events"
    assert said.endswith("clawback adapters rollback base")
    said = forget_text({"scope": "session", "sessions": 1, "deleted": {"calls": 1}, "affected_versions": [],
                        "rollback_to": None, "scrubbed": {"calls": 3, "samples_dropped": 1}})
    assert said.splitlines()[1] == ("took the forgotten notes out of 3 calls of other sessions that were served with "
                                    "them; 1 sample not yet trained on went with them")
    listing = adapters_text({"live": 1, "data": [
        {"version": 1, "state": "live", "pinned": False, "parent": None, "samples": 16,
         "metrics": {"loss": 0.5, "reward_mean": 0.25}, "gate": None, "reason": None},
        {"version": 2, "state": "refused", "pinned": True, "parent": 1, "samples": 16, "metrics": {},
         "gate": {"retention": {"candidate": 50.0}}, "reason": "collapse: token entropy"}]})
    lines = listing.splitlines()
    assert lines[0] == "live: v1" and lines[1].split() == ["version", "state", "pinned", "parent", "samples", "loss",
                                                           "reward", "probes", "kept"]
    assert lines[3].split() == ["v2", "refused", "yes", "v1", "16", "–", "–", "50/100"]
    assert lines[-1] == "v2 not promoted: collapse: token entropy"


def test_a_sample_state_says_why():
    assert sample_state("dropped", "held_out").startswith("held out for the gate")
    assert sample_state("dropped", "cut_off") == \
        "dropped: the reply was cut off by its token limit (max_tokens) before it ended"
    assert sample_state("dropped", "processing_failed: boom") == "dropped: processing failed: boom"
    assert sample_state("pending_judge") == "waiting for the judge" and sample_state(None) == "no sample"


def test_table_pads_columns():
    assert table(["a", "bb"], [["xxx", "y"]]) == "a    bb\nxxx  y"


def test_a_reward_says_where_it_came_from():
    assert reward_origin(1.0, "explicit") == "reward +1 from the person's 👍"
    assert reward_origin(-1.0, "explicit") == "reward -1 from the person's 👎"
    assert reward_origin(-1.0, "outcome_rule", "traceback") == "reward -1 from outcome rule traceback"
    assert reward_origin(0.71, "outcome_event", "ci") == "reward +0.71 from outcome event from ci"
    assert reward_origin(1.0, "judge") == "reward +1 from the judge"
    assert reward_origin(0.0, "none") == reward_origin(None, None) == "no reward"
