"""The Cluster page's heatmap cells, down GPUs and nodes included, and the same
picture in words for screen readers.

A GPU that is down reports no value, so it was a blank cell, the node whose agent is
unreachable had no row at all: what is most wrong was least visible. Pure functions
on the page's frames, so they are tested without a browser.
"""

from __future__ import annotations

import pandas as pd

from clusterpulse.dashboard import explain

NODE_DOWN = "node down: its agent is unreachable"


def cells(heat: pd.DataFrame, down: pd.DataFrame, nodes: pd.DataFrame) -> pd.DataFrame:
    """node, gpu (int), value, state ("ok", "GPU down: <why>", NODE_DOWN)."""
    rows = {(r["node"], int(r["gpu"])): (r["value"], "ok")
            for _, r in (heat.iterrows() if not heat.empty else [])}
    for _, r in (down.iterrows() if not down.empty else []):
        why = explain.down_reason(r.get("reason", "unknown"))
        rows[(r["node"], int(r["gpu"]))] = (float("nan"), f"GPU down: {why}")
    gpus = sorted({g for _, g in rows}) or [0]
    for _, r in (nodes[nodes["up"] == 0].iterrows() if not nodes.empty else []):
        rows = {k: v for k, v in rows.items() if k[0] != r["node"]}
        rows.update({(r["node"], g): (float("nan"), NODE_DOWN) for g in gpus})
    return pd.DataFrame([{"node": n, "gpu": g, "value": v, "state": st}
                         for (n, g), (v, st) in sorted(rows.items())],
                        columns=["node", "gpu", "value", "state"])


def summary(c: pd.DataFrame, metric: str, unit: str, good_high: bool) -> str:
    """The heatmap in one paragraph: its worst and best GPU, and every down one."""
    ok = c[c["state"] == "ok"].dropna(subset=["value"])
    parts = [f"{metric.capitalize()} ({unit}) of {len(ok)} GPU(s) on {ok['node'].nunique()} "
             "node(s)"]
    if not ok.empty:
        order = ok.sort_values("value", ascending=good_high)
        worst, best = order.iloc[0], order.iloc[-1]
        parts.append(f"worst: {worst['node']} GPU {worst['gpu']} at {worst['value']:.0f} {unit}"
                     f"; best: {best['node']} GPU {best['gpu']} at {best['value']:.0f} {unit}")
    bad = c[c["state"] != "ok"]
    gone = bad[bad["state"] == NODE_DOWN]["node"].unique()
    gpus_down = bad[bad["state"] != NODE_DOWN]
    if len(gpus_down):
        parts.append(f"{len(gpus_down)} GPU(s) DOWN: " + "; ".join(
            f"{r['node']} GPU {r['gpu']} ({r['state'][len('GPU down: '):].split(':')[0]})"
            for _, r in gpus_down.iterrows()))
    if len(gone):
        parts.append(f"{len(gone)} node(s) DOWN (agent unreachable): {', '.join(gone)}")
    if not len(bad):
        parts.append("no GPU or node down")
    return ". ".join(parts) + "."


# The Run page's compute heatmap draws at most this many time columns: more are too
# narrow to click or read.
TIME_COLUMNS = 40


def time_buckets(frame: pd.DataFrame, most: int = TIME_COLUMNS) -> pd.DataFrame:
    """`frame` (one row per time, a column per series) in at most `most` rows, each the
    mean of consecutive rows, labelled with its first time: the chosen window in full.
    The Run page drew the last 40 points (`tail(40)`), the last 40 steps of the range,
    5 min of a custom 6 h window that the page said nothing of."""
    if len(frame) <= most:
        return frame
    group = (pd.RangeIndex(len(frame)) * most) // len(frame)
    out = frame.groupby(group).mean()
    out.index = frame.index[pd.Series(group).drop_duplicates().index]
    return out

