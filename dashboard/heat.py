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


RANK_GPU_DOWN = "GPU down"  # a compute heatmap cell's state while its rank's GPU is down


def rank_cells(compute: pd.DataFrame, down: pd.DataFrame, most: int = TIME_COLUMNS
               ) -> pd.DataFrame:
    """The Run page's compute heatmap: time, rank ("rank N"), seconds, state ("ok" or
    RANK_GPU_DOWN) and word (the cell the DOWN word is drawn on), in at most `most` time
    columns (`time_buckets`).

    `compute`: each rank's compute seconds by time; `down`: 1 where the rank's GPU was
    down (a query's points, absent elsewhere). A rank keeps reporting its last step's
    figures once its GPU is lost, so its latest cell was drawn in the brightest colour
    as if healthy while the banner above said its GPU was DOWN: a column where its GPU
    was down at any point is a down cell, with no value (the figure is stale), drawn
    even where the rank reported nothing. The word is on the last cell of each stretch
    of down cells only: a column of a 40-column chart is narrower than the word, and
    one on each cell overlapped into a smear. Cells with no value and no down state
    (the rank reported no step then: a restart, or before it began) stay blank."""
    index = compute.index.union(down.index)
    ranks = sorted(set(compute.columns) | set(down.columns), key=lambda r: int(r.split()[-1]))
    values = time_buckets(compute.reindex(index=index, columns=ranks), most)
    was_down = time_buckets((down.reindex(index=index, columns=ranks) > 0).astype(float),
                            most) > 0
    word = was_down & ~was_down.shift(-1, fill_value=False).astype(bool)

    def long(frame: pd.DataFrame, name: str) -> pd.DataFrame:  # a row per time and rank
        return frame.reset_index(names="time").melt(id_vars="time", var_name="rank",
                                                    value_name=name)

    out = long(values.mask(was_down), "seconds").assign(down=long(was_down, "d")["d"],
                                                        word=long(word, "w")["w"])
    out = out[out["down"] | out["seconds"].notna()].sort_values("time", kind="stable")
    out["state"] = out["down"].map({True: RANK_GPU_DOWN, False: "ok"})
    return out[["time", "rank", "seconds", "state", "word"]].reset_index(drop=True)


def rank_summary(c: pd.DataFrame) -> str:
    """The compute heatmap in words: its slowest and fastest rank (each rank's latest
    healthy cell), and each rank whose GPU was down, with whether it still is."""
    columns = c["time"].nunique()
    parts = [f"Compute time (s) of {c['rank'].nunique()} rank(s) in {columns} time column(s)"]
    latest = c[c["state"] == "ok"].dropna(subset=["seconds"]).groupby("rank").last()
    if not latest.empty:
        order = latest["seconds"].sort_values()
        parts.append(f"slowest: {order.index[-1]} at {order.iloc[-1]:.2f} s; fastest: "
                     f"{order.index[0]} at {order.iloc[0]:.2f} s (each rank's latest "
                     "healthy cell)")
    last_time = c["time"].max()
    down = c[c["state"] != "ok"]
    if len(down):
        parts.append(f"{down['rank'].nunique()} rank(s) with their GPU DOWN: " + "; ".join(
            f"{rank} in {len(cells)} of {columns} column(s)"
            + (", the latest included" if (cells["time"] == last_time).any() else "")
            for rank, cells in down.groupby("rank", sort=False)))
    else:
        parts.append("no rank's GPU down")
    return ". ".join(parts) + "."
