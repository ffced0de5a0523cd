"""The summary as one PNG per scenario (`<out>/<scenario>.png`)."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .results import Summary


def plot(summary: Summary, out: Path) -> list[Path]:
    """One PNG per scenario, one line per method: the share of seeds whose reply met the preference
    in each session (left), the probe on every version as served and, dashed, without the notes
    (middle) and the held-out greedy score at
    the evaluation points with its 95% band over seeds (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for scen, methods in summary["scenarios"].items():
        fig, (ax_m, ax_p, ax_s) = plt.subplots(1, 3, figsize=(15, 4.2))
        for method, s in methods.items():
            xs = list(range(len(s["mean"])))
            label = f"{method} (n={len(s['seeds'])}, adapted {s['adapted']})"
            line, = ax_s.step(xs, s["mean"], where="post", label=label)
            if s.get("meets_by_session"):
                ax_m.plot(range(1, len(s["meets_by_session"]) + 1), s["meets_by_session"], marker=".",
                          color=line.get_color(), label=label)
            if len(s["seeds"]) > 1:
                ax_s.fill_between(xs, s["low"], s["high"], step="post", alpha=0.15, color=line.get_color())
            if s.get("probe_mean"):
                ax_p.step(xs, s["probe_mean"], where="post", color=line.get_color(), label=label)
            if s.get("probe_off_mean"):
                ax_p.step(xs, s["probe_off_mean"], where="post", color=line.get_color(), linestyle="--")
        missing = [k for k in summary["missing"] if k.startswith(f"{scen}/")]
        title = f"{scen} (code {summary['code_stamp']})"
        if missing:
            title += "\n" + textwrap.fill(f"missing cells: {', '.join(k.split('/', 1)[1] for k in missing)}", 120)
        fig.suptitle(title, fontsize=9)
        ax_m.set_title("replies meeting the preference (share of seeds, per session)", fontsize=9)
        ax_p.set_title("probe: mass on rule-meeting openers (every version; dashed: notes off)", fontsize=9)
        ax_s.set_title("held-out greedy score (mean, 95% interval over seeds)", fontsize=9)
        for ax in (ax_m, ax_p, ax_s):
            ax.set_xlabel("interactions (sessions)")
            ax.set_ylim(0, 1.02)
            ax.grid(alpha=0.3)
        ax_s.legend(fontsize=7, loc="best")
        fig.tight_layout()
        path = out / f"{scen}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
