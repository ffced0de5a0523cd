"""Which tokens a run's distillation pushed up, beyond a reply's opening tokens: over the trained
samples with a top-K teacher, per hint source, the summed positive advantage (teacher logprob −
the policy's logprob in the context it trains in, each of the recorded top-K tokens) of each
token at positions from `--from` on. Reads a copy of a run's store; no model run (the tokenizer
only).

    python bench/opd_gain.py --db OUT/.work/great/default_consolidated/seed2/data/clawback.db \
        --model ~/.clawback/models/qwen2.5-coder-0.5b-instruct
"""

from __future__ import annotations

import argparse
import collections
import json
import sqlite3
from pathlib import Path


def main(args: argparse.Namespace) -> dict[str, dict]:
    from transformers import AutoTokenizer

    from clawback.daemon.store.schema import blob_ids, blob_logprobs, blob_rows

    tok = AutoTokenizer.from_pretrained(str(args.model))
    conn = sqlite3.connect(f"file:{args.db}?mode=ro", uri=True)
    conn.row_factory = sqlite3.Row
    gains: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    samples: collections.Counter[str] = collections.Counter()
    for r in conn.execute(
            "SELECT s.hint_source, s.teacher_top_logprobs, s.student_top_logprobs, c.response_ids, c.top_ids, "
            "c.top_logprobs FROM samples s JOIN calls c USING (call_id) "
            "WHERE s.state = 'consumed' AND s.teacher_top_logprobs IS NOT NULL"):
        length = len(blob_ids(r["response_ids"]))
        ids = blob_rows(blob_ids, r["top_ids"], length)
        teacher = blob_rows(blob_logprobs, r["teacher_top_logprobs"], length)
        # a consolidated sample trains in the request without the notes, against the policy there
        policy = blob_rows(blob_logprobs, r["student_top_logprobs"] or r["top_logprobs"], length)
        samples[r["hint_source"]] += 1
        for t in range(args.start, length):
            for i, lt, lp in zip(ids[t], teacher[t], policy[t]):
                if lt > lp:
                    gains[r["hint_source"]][tok.decode([i])] += lt - lp
    return {src: {"samples": samples[src], "top": [(w, round(g, 1)) for w, g in gains[src].most_common(args.top)]}
            for src in gains}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--db", type=Path, required=True)
    p.add_argument("--model", type=Path, required=True, help="the run's model (for its tokenizer)")
    p.add_argument("--from", dest="start", type=int, default=3, help="first reply position counted")
    p.add_argument("--top", type=int, default=12)
    print(json.dumps(main(p.parse_args()), indent=1, ensure_ascii=False))
