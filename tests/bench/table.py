"""One row format for every benchmark: what, ours, baseline, ratio, budget."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Row:
    what: str
    ours: float
    unit: str
    baseline: float | None = None
    baseline_name: str = ""
    budget: str = ""

    @property
    def ratio(self) -> str:
        if self.baseline in (None, 0):
            return "-"
        return f"{self.ours / self.baseline:.3f}"


def fmt(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.4g}"


def render(rows: list[Row]) -> str:
    head = ["benchmark", "ours", "unit", "baseline", "baseline is", "ratio", "budget"]
    body = [[r.what, fmt(r.ours), r.unit, fmt(r.baseline), r.baseline_name, r.ratio, r.budget]
            for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body, strict=False)]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)) + " |"
              for row in body]
    return "\n".join(lines)
