"""deploy/grafana: every panel's PromQL returns data from a live Prometheus scraping
simulated agents while a real torchrun job reports, and the dashboards are well-formed."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.support.procs import wait_until
from tests.support.promtool import rules_pass
from tests.support.stack import Stack

REPO = Path(__file__).resolve().parents[2]
BOARDS = sorted((REPO / "deploy" / "grafana").glob("*.json"))
RUN = "grafana"


def _exprs() -> list[tuple[str, str, str]]:
    """(dashboard, panel title, expr) for every target of every panel."""
    out = []
    for path in BOARDS:
        board = json.loads(path.read_text())
        for panel in board["panels"]:
            for t in panel["targets"]:
                out.append((board["uid"], panel["title"], t["expr"]))
    return out


def _concrete(expr: str, node: str) -> str:
    """Grafana's substitutions: the variables as a user would pick them."""
    return (expr.replace("$__rate_interval", "1m").replace("$node", node)
            .replace("$run", RUN))


def test_dashboards_are_well_formed():
    assert {p.stem for p in BOARDS} == {"clusterpulse-fleet", "clusterpulse-node",
                                        "clusterpulse-run"}
    for path in BOARDS:
        board = json.loads(path.read_text())
        assert board["uid"] == path.stem
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids))
        names = {v["name"] for v in board["templating"]["list"]}
        for p in board["panels"]:
            assert p["datasource"]["uid"] == "${datasource}"
            for t in p["targets"]:
                used = set(re.findall(r"\$(\w+)", t["expr"])) - {"__rate_interval"}
                assert used <= names, f"{p['title']}: undefined variable {used - names}"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack.start(tmp_path_factory.mktemp("grafana"), nodes=1, gpus=2)
    s.start_job(RUN, steps=100000, ranks_per_node=2, trainer_args=["--ckpt-every", "20"])
    yield s
    s.stop()


@pytest.mark.integration
@pytest.mark.slow
def test_every_panel_query_returns_data(stack):
    node = stack.nodes[0].name
    exprs = _exprs()
    # Template variables' own queries must find the node and the run.
    variables = {"label_values(clusterpulse_gpu_info, node)": ("clusterpulse_gpu_info", node),
                 "label_values(clusterpulse_trainer_step, run)": ("clusterpulse_trainer_step", RUN)}
    for path in BOARDS:
        for v in json.loads(path.read_text())["templating"]["list"]:
            if v["type"] == "query":
                assert v["definition"] in variables, v["definition"]

    def empty() -> list[str]:
        missing = [f"{uid} / {title}: {expr}" for uid, title, expr in exprs
                   if not stack.prom.query(_concrete(expr, node))]
        missing += [q for q, (metric, value) in variables.items()
                    if value not in {s["metric"].get(q.split(", ")[1][:-1])
                                     for s in stack.prom.query(metric)}]
        return missing

    try:
        wait_until(lambda: not empty(), 240, "data for every Grafana panel", interval=2)
    except AssertionError:
        raise AssertionError("panels without data:\n" + "\n".join(empty())) from None


def test_dcgm_compat_rules_pass_their_promtool_tests():
    """The opt-in dcgm-exporter names, with DCGM's units and labels (promtool unit test)."""
    rules_pass("tests/dcgm_compat_test.yml", cwd=REPO / "deploy" / "grafana")
