"""The heatmaps' Vega-Lite specs (dashboard/ui.heatmap_spec), read as the browser gets
them: what a click on a cell opens, what a colour means, in which order the columns come.

A review during the demo's faults clicked the word DOWN on a lost GPU's cell and got
nothing (only the cell's edge around the word carried the link)."""

from __future__ import annotations

import pandas as pd

from clusterpulse.dashboard import heat, ui


def cluster_cells() -> pd.DataFrame:
    """node-a's GPU 2 down, node-c unreachable: the demo's faults."""
    hot = pd.DataFrame({"node": ["node-a"] * 3 + ["node-b"] * 4,
                        "gpu": ["0", "1", "3", "0", "1", "2", "3"],
                        "value": [63.0, 64.0, 89.0, 60.0, 61.0, 62.0, 63.0]})
    down = pd.DataFrame({"node": ["node-a"], "gpu": ["2"], "reason": ["gpu_is_lost"]})
    nodes = pd.DataFrame({"node": ["node-a", "node-b", "node-c"], "up": [1, 1, 0]})
    cells = heat.cells(hot, down, nodes)
    cells["url"] = [f"node?node={n}&gpu={g}" for n, g in zip(cells["node"], cells["gpu"],
                                                              strict=True)]
    return cells


def layers(spec: dict) -> list[dict]:
    return spec.get("layer", [spec])


def test_every_mark_of_a_linked_cell_opens_its_evidence_the_down_word_included():
    spec = ui.heatmap_spec(cluster_cells(), "gpu", "node", "value", "°C")
    marks = layers(spec)
    assert {m["mark"]["type"] for m in marks} == {"rect", "text"}
    for m in marks:  # the same URL as the cell's, and a hand over each
        assert m["encoding"]["href"] == {"field": "url", "type": "nominal"}, m["mark"]
        assert m["mark"]["cursor"] == "pointer", m["mark"]
    word = next(m for m in marks if m["mark"]["type"] == "text")
    assert word["mark"]["text"] == "DOWN" and word["transform"] == [
        {"filter": "datum.state !== 'ok'"}]


def test_a_heatmap_without_urls_has_no_links():
    spec = ui.heatmap_spec(cluster_cells().drop(columns="url"), "gpu", "node", "value", "°C")
    assert all("href" not in m["encoding"] and m["mark"].get("cursor", "default") == "default"
               for m in layers(spec))


def colour_scale(spec: dict) -> dict:
    return next(m for m in layers(spec) if "color" in m["encoding"])["encoding"]["color"]["scale"]


def test_a_colour_means_the_same_temperature_on_every_load():
    """A normal 63 °C was the same bright colour as a throttling 89 °C when those two
    were the extremes of the values shown: the scale is fixed round the throttle line."""
    from clusterpulse.dashboard.data import GPU_THROTTLE_C, HEATMAP_DOMAINS, HEATMAP_METRICS

    low, high = HEATMAP_DOMAINS["temperature"]
    assert low < 63 < GPU_THROTTLE_C < 89 < high
    assert HEATMAP_DOMAINS["utilization"] == (0, 100)
    assert set(HEATMAP_DOMAINS) <= set(HEATMAP_METRICS)
    spec = ui.heatmap_spec(cluster_cells(), "gpu", "node", "value", "°C",
                           domain=HEATMAP_DOMAINS["temperature"])
    assert colour_scale(spec) == {"scheme": ui.SCALE, "reverse": False,
                                  "domain": [low, high], "clamp": True}
    # and without one (power: its range depends on the GPU) the scale spans the values
    assert "domain" not in colour_scale(ui.heatmap_spec(cluster_cells(), "gpu", "node",
                                                        "value", "W"))


def test_gpu_columns_are_in_numeric_order_whichever_is_down():
    """node-a's GPU 2 down: the ok layer had 0, 1, 3 and the down layer 2, and the axis
    read 0, 1, 3, 2. The order is given, the same for every layer."""
    cells = cluster_cells()
    spec = ui.heatmap_spec(cells, "gpu", "node", "value", "°C",
                           x_order=sorted({int(g) for g in cells["gpu"]}))
    for m in layers(spec):
        assert m["encoding"]["x"]["sort"] == [0, 1, 2, 3]
        assert m["encoding"]["y"]["sort"] == ["node-a", "node-b", "node-c"]
    ten = pd.DataFrame({"node": ["a"] * 3, "gpu": [10, 2, 1], "value": [1.0, 2.0, 3.0]})
    assert ui.heatmap_spec(ten, "gpu", "node", "value", "x", x_order=[1, 2, 10]
                           )["encoding"]["x"]["sort"] == [1, 2, 10]


def test_the_compute_heatmap_covers_the_whole_window_in_at_most_40_columns():
    """It drew the last 40 points (`comp.tail(40)`): 6 min of a custom 6 h window."""
    times = pd.date_range("2026-01-31T14:00", periods=720, freq="30s")  # 6 h
    comp = pd.DataFrame({"rank 0": 0.15, "rank 3": [0.15] * 360 + [0.3] * 360}, index=times)
    got = heat.time_buckets(comp)
    assert len(got) == heat.TIME_COLUMNS == 40
    assert got.index[0] == times[0] and got.index[-1] > times[-30]  # both ends of the window
    assert got.index.is_monotonic_increasing
    assert list(got["rank 3"]) == [0.15] * 20 + [0.3] * 20  # each column the mean of its points
    short = comp.iloc[:12]
    assert heat.time_buckets(short) is short  # nothing to bucket


def test_a_rank_is_down_in_each_column_its_gpu_was_down_and_the_word_ends_each_stretch():
    """The compute heatmap drew a rank on a lost GPU in the brightest colour (the last
    step time it kept reporting) while the page's banner said its GPU was DOWN."""
    times = pd.date_range("2026-01-31T14:00", periods=10, freq="5s")
    comp = pd.DataFrame({"rank 0": 0.15, "rank 2": [0.15] * 3 + [float("nan")] * 2
                         + [0.4] * 5}, index=times)
    down = pd.DataFrame({"rank 2": 1.0}, index=times[[1, 6, 7, 8, 9]])
    cells = heat.rank_cells(comp, down)
    two = cells[cells["rank"] == "rank 2"].set_index("time")
    assert list(two["state"]) == ["ok", heat.RANK_GPU_DOWN, "ok", "ok"] + [
        heat.RANK_GPU_DOWN] * 4
    assert times[3] not in two.index and times[4] not in two.index  # a restart: blank
    assert two["seconds"].where(two["state"] != "ok").isna().all()  # not its stale 0.4 s
    assert list(two.index[two["word"]]) == [times[1], times[9]]  # the end of each stretch
    assert not cells[cells["rank"] == "rank 0"]["word"].any()
    spec = ui.heatmap_spec(cells, "time", "rank", "seconds", "compute s")
    word = next(m for m in layers(spec) if m["mark"]["type"] == "text")
    assert word["mark"]["text"] == "DOWN" and word["transform"][-1] == {"filter": "datum.word"}
    text = heat.rank_summary(cells)
    assert "1 rank(s) with their GPU DOWN: rank 2 in 5 of 10 column(s), the latest included" \
        in text, text
