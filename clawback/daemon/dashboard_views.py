"""The dashboard's view helpers: charts, pagers, numbers and text as its templates show them."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

PAGE_SIZE = 10  # rows per page of the long lists (feedback, versions, conversations)
QUIET_HOUR_S = 3600
SERIES_COLORS = {"good": "#1a7f4b", "bad": "#b3261e", "corrections": "#c80"}


def chart(title: str, x: Sequence[object], xlabels: list[str] | None, series: dict[str, list[float | None]],
          small: bool = False) -> dict[str, object]:
    """A chart for dashboard.js; series as a list, in order, each with its colour (the template's
    JSON sorts object keys, so a dict would lose the order the colours follow)."""
    return {"title": title, "x": x, "xlabels": xlabels, "small": small,
            "series": [{"label": name, "values": values, "color": SERIES_COLORS.get(name)}
                       for name, values in series.items()]}


def finite(x: object) -> float | None:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


def simulate_summary(data_dir: Path) -> list[dict[str, object]] | None:
    """`clawback simulate --out <data_dir>/simulate` leaves summary.json there: score before and after."""
    path = data_dir / "simulate" / "summary.json"
    try:
        summary = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    rows = []
    for scenario, methods in summary.get("scenarios", {}).items():
        for method, cell in methods.items():
            mean = cell.get("mean") or [None]
            rows.append({"scenario": scenario, "method": method, "seeds": len(cell.get("seeds", [])),
                         "before": mean[0], "after": mean[-1]})
    return rows


def pager(name: str, page: int, total: int) -> dict[str, object]:
    pages = max(1, math.ceil(total / PAGE_SIZE))
    return {"name": name, "page": page, "pages": pages, "total": total,
            "first": (page - 1) * PAGE_SIZE + 1, "last": min(total, page * PAGE_SIZE)}


def message_text(content: object) -> str:
    """Message content as text (OpenAI content may be a list of parts)."""
    if isinstance(content, list):
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def untagged_only(last_untagged: float | None, last_main: float | None, now: float) -> bool:
    """Untagged calls in the last hour and no tagged main call: the plugin is not sending
    X-Turn-Type, the most common reason nothing ever trains."""
    recent = now - QUIET_HOUR_S
    return last_untagged is not None and last_untagged > recent and (last_main is None or last_main < recent)
