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
