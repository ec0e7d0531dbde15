"""What the Run page shows about a hang and a straggler, from the run's data dict.

A hang is one incident: its root rank(s) (behind the others in collectives entered,
as RankHung pages them) and the ranks that wait for them, with the collective each
waits in. Pure functions over `dashboard.data.run`'s result, so they are tested
without a browser.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class HangIncident:
    roots: list[str]  # ranks; empty when the root cannot be told (the job is paged)
    waiters: dict[str, str] = field(default_factory=dict)  # rank -> what it waits in
    nodes: dict[str, str] = field(default_factory=dict)  # rank -> node

    def headline(self) -> str:
        def where(rank: str) -> str:
            return f"rank {rank} on {self.nodes.get(rank, '?')}"

        waits = sorted(set(self.waiters.values()) - {""})
        waiting = f"{len(self.waiters)} rank(s) wait" + (f" in {', '.join(waits)}"
                                                         if waits else "")
        if not self.roots:
            return f"Job stalled, no root can be told: {waiting}."
        return f"Hang rooted at {', '.join(where(r) for r in self.roots)}; {waiting}."


def hang_incident(d: dict) -> HangIncident | None:
    """None unless some rank is past its hang threshold."""
    per = d["per_rank"]
    margin = per.get("hang margin s", {})
    stalled = [r for r, m in margin.items() if m is not None and m > 0]
    if not stalled:
        return None
    behind = per.get("collectives behind", {})
    roots = sorted((r for r in stalled if (behind.get(r) or 0) > 0), key=int)
    nodes = {}
    ranks = d.get("ranks")
    if ranks is not None and not ranks.empty:
        nodes = dict(zip(ranks["rank"], ranks["node"], strict=False))
    waiters = {r: d.get("blocked", {}).get(r, "") for r in sorted(stalled, key=int)
               if r not in roots}
    return HangIncident(roots, waiters, nodes)


def straggler_flag(score: float | None, flagged: float | None, threshold: float = 1.1) -> str:
    """The scorer's decision when the rank reports it, else score over the threshold."""
    if flagged is not None and flagged == flagged:
        return "STRAGGLER" if flagged >= 1 else ""
    return "STRAGGLER" if score and score > threshold else ""
