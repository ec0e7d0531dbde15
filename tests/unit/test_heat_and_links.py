"""Down is visible: the Cluster heatmap's cells and words, the Node page's link rows.

A lost GPU was a blank heatmap cell and, on the Node page, `Gennan xnan (max Gennan
xnan)`, NVLinks `0 / 0`, health ok; a node whose agent is unreachable had no row."""

from __future__ import annotations

import pandas as pd
import yaml

from clusterpulse.dashboard import explain, heat
from clusterpulse.dashboard.data import (
    FAILING_SHARE,
    HEATMAP_METRICS,
    failing_readings,
    gpu_link_health,
)
from clusterpulse.dashboard.promclient import Sample
from tests.support.procs import REPO


def frames():
    hot = pd.DataFrame({"node": ["a", "a", "b"], "gpu": ["0", "1", "1"],
                        "value": [91.0, 55.0, 60.0]})
    down = pd.DataFrame({"node": ["b"], "gpu": ["0"], "reason": ["gpu_is_lost"]})
    nodes = pd.DataFrame({"node": ["a", "b", "c"], "up": [1, 1, 0]})
    return hot, down, nodes


def test_down_gpus_and_nodes_have_cells_of_their_own():
    c = heat.cells(*frames())
    states = {(r.node, r.gpu): r.state for r in c.itertuples()}
    assert states[("a", 0)] == "ok"
    assert states[("b", 0)].startswith("GPU down: gpu_is_lost: fell off the bus")
    assert states[("c", 0)] == states[("c", 1)] == heat.NODE_DOWN


def test_the_summary_says_in_words_what_the_colours_say():
    text = heat.summary(heat.cells(*frames()), "temperature", "°C", good_high=False)
    assert "worst: a GPU 0 at 91 °C" in text and "best: a GPU 1 at 55 °C" in text
    assert "1 GPU(s) DOWN: b GPU 0 (gpu_is_lost)" in text
    assert "1 node(s) DOWN (agent unreachable): c" in text


def test_the_default_metric_shows_a_gpu_in_trouble():
    assert next(iter(HEATMAP_METRICS)) == "temperature"


def test_a_lost_gpu_is_down_with_its_reason_not_nan_and_ok():
    wide = pd.DataFrame({"gpu": ["0", "1"], "pcie_gen": [5.0, float("nan")],
                         "pcie_gen_max": [5.0, float("nan")], "pcie_width": [16.0, float("nan")],
                         "pcie_width_max": [16.0, float("nan")],
                         "pcie_replays_10m": [0.0, float("nan")], "nvlinks": [18.0, float("nan")],
                         "nvlinks_up": [18.0, float("nan")],
                         "nvlink_errors_10m": [0.0, float("nan")]})
    rows = gpu_link_health(wide, {"1": "gpu_is_lost"}).set_index("gpu")
    assert rows.loc["0", "PCIe"] == "Gen5 x16 (max Gen5 x16)" and rows.loc["0", "health"] == "ok"
    assert rows.loc["1", "health"].startswith("DOWN: gpu_is_lost: fell off the bus")
    assert "nan" not in rows.loc["1", "PCIe"] + rows.loc["1", "NVLinks up"]
    # a GPU that reports no link series and is not known down: said so, not 'Gennan'
    alone = gpu_link_health(wide.iloc[[1]]).iloc[0]
    assert alone["PCIe"] == "not reported" and "nan" not in alone["NVLinks up"]


def test_a_restarting_job_says_so_instead_of_step_0():
    from clusterpulse.dashboard.data import jobs
    from clusterpulse.dashboard.promclient import Sample

    got = jobs([Sample({"run": "a", "part": "step"}, 0.0),
                Sample({"run": "a", "part": "restarting"}, 1.0),
                Sample({"run": "a", "part": "checkpoint"}, 150.0),
                Sample({"run": "b", "part": "step"}, 812.0),
                Sample({"run": "b", "part": "checkpoint"}, 800.0)]).set_index("run")
    assert got.loc["a", "state"] == "restarting from checkpoint 150"
    assert pd.isna(got.loc["a", "step"])  # not "step 0": a restarted rank's step before loading
    assert (got.loc["b", "step"], got.loc["b", "state"]) == (812.0, "training")
    # a new run whose ranks are all still loading is a running job ("Running jobs 0")
    new = jobs([Sample({"run": "c", "part": "restarting"}, 1.0)]).set_index("run")
    assert new.loc["c", "state"] == "starting" and pd.isna(new.loc["c", "step"])
    assert jobs([Sample({"run": "old", "part": "checkpoint"}, 50.0)]).empty


def test_the_run_pages_step_says_restarting_instead_of_step_0():
    """The screenshots of the demo's hang showed the Run page's Step figure at 0 while
    the ranks restarted (the Jobs table above had been fixed, this figure not)."""
    from clusterpulse.dashboard.data import run_step

    restarting = {"step": {"0": 0.0, "1": 0.0}, "checkpoint step": {"0": 150.0, "1": 150.0}}
    assert run_step(restarting) == ("restarting", "from checkpoint step 150")
    # one rank already past its checkpoint: training again
    assert run_step({"step": {"0": 151.0, "1": 0.0}, "checkpoint step": {"0": 150.0}}) == \
        ("151", None)
    assert run_step({"step": {"0": 42.0}, "checkpoint step": {}}) == ("42", None)
    # no rank reports a step (a finished run past its agents' grace): a dash, not 0
    assert run_step({"step": {}, "checkpoint step": {}}) == ("\u2014", None)


def test_the_node_page_warns_of_failing_readings_at_the_alerts_ratio_for_the_card_up():
    """Two reviews of the Node page's warning: one failed reading warned for 10 minutes as
    "0 %" of the cycles, in the present tense after the fault had cleared, a card
    replaced at the same index inherited the old card's warning, and "104 %" (increase
    extrapolates) could be read."""
    def failing(part: str, gpu: str, uuid: str, metric: str) -> Sample:
        return Sample({"part": part, "gpu": gpu, "uuid": uuid, "metric": metric}, 1)

    def card(part: str, gpu: str, uuid: str, value: float = 1) -> Sample:
        return Sample({"part": part, "gpu": gpu, "uuid": uuid}, value)

    samples = [
        failing("window", "0", "GPU-a", "temperature_celsius"),
        failing("window", "0", "GPU-a", "power_watts"), failing("now", "0", "GPU-a", "power_watts"),
        card("share", "0", "GPU-a", 1.04), card("up", "0", "GPU-a"),
        # one failed cycle in 10 minutes: no warning
        failing("window", "1", "GPU-b", "power_watts"), card("share", "1", "GPU-b", 1 / 600),
        card("up", "1", "GPU-b"),
        # the card at index 2 was replaced: the old one failed, the one up now did not
        failing("window", "2", "GPU-old", "power_watts"), card("share", "2", "GPU-old", 1.0),
        card("up", "2", "GPU-new"),
        # no cycles counted: nothing to say
        failing("window", "3", "GPU-d", "power_watts"), card("share", "3", "GPU-d", float("nan")),
        card("up", "3", "GPU-d")]
    found = failing_readings(samples)
    assert list(found) == ["0"], found
    f = found["0"]
    assert (f.share, f.readings, f.now) == (1.0, ["power_watts", "temperature_celsius"],
                                            ["power_watts"])
    assert explain.failing_readings("0", f.share, f.readings, f.now) == (
        "GPU 0: NVML fails its readings in 100% of the agent's cycles of the last 10 minutes "
        "(power_watts, temperature_celsius), and in the latest cycle (power_watts). Those "
        "charts have gaps for it and the alerts that read them cannot fire for it "
        "(GpuReadingsFailing fires at half the cycles for 5 minutes).")
    cleared = failing_readings([x for x in samples if x.labels["part"] != "now"])["0"]
    assert explain.failing_readings("0", 0.62, cleared.readings, cleared.now) == (
        "GPU 0: NVML failed its readings in 62% of the agent's cycles of the last 10 minutes "
        "(power_watts, temperature_celsius), none in the latest cycle. Those charts have "
        "gaps for it in that time.")
    # the page warns from the alert's own ratio
    rules = yaml.safe_load((REPO / "deploy/prometheus/alerts.rules.yml").read_text())
    (rule,) = [r for g in rules["groups"] for r in g["rules"]
               if r.get("alert") == "GpuReadingsFailing"]
    assert f">= {FAILING_SHARE}" in rule["expr"], rule["expr"]


def test_a_run_with_no_rank_reporting_shows_dashes_not_zeros():
    """Found in review: a cleanly finished run's page read "Loss nan", "Goodput 0 %" and
    "Last checkpoint none" while the Jobs table said it exited at step 500."""
    from clusterpulse.dashboard.data import run_figures

    empty = {k: {} for k in ("step", "loss", "goodput", "restarts", "checkpoint step")}
    assert set(run_figures(empty).values()) == {"\u2014"}
    last = {"step": {"0": 500.0}, "loss": {"0": 1.25}, "goodput": {"0": 0.875},
            "restarts": {"0": 1.0}, "checkpoint step": {}}
    assert run_figures(last) == {"Loss": "1.250", "Restarts": "1", "Goodput": "88 %",
                                 "Last checkpoint": "none"}
