"""Every shipped scrape config splits the agent the same way: the ranks' progress from
/metrics/progress every second (job rank-progress), the rest from /metrics at the
scrape interval with exactly those families dropped. A drop regex that misses a
family would store two series a rank for it (one per job); one that drops more would
lose a series nothing else brings."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import requests
import yaml
from prometheus_client.parser import text_string_to_metric_families

from clusterpulse.agent.exporter import PROGRESS_FAMILIES
from tests.support.ranksock import RankProcess

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _static(path: Path, text: str | None = None) -> list[tuple[dict, dict]]:
    """(main job, progress job) of a Prometheus-format scrape config."""
    cfg = yaml.safe_load(text if text is not None else path.read_text())
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    main, progress = jobs["clusterpulse"], jobs["rank-progress"]
    assert (progress["scrape_interval"], progress["metrics_path"]) == \
        ("1s", "/metrics/progress"), path
    for key in ("static_configs", "file_sd_configs", "relabel_configs"):
        assert main.get(key) == progress.get(key), f"{path}: {key} differ between the jobs"
    (drop,) = main["metric_relabel_configs"]
    assert (drop["source_labels"], drop["action"]) == (["__name__"], "drop"), path
    return [(path.name, drop["regex"])]


def _configs() -> list[tuple[str, str]]:
    out = _static(DEPLOY / "prometheus" / "prometheus.example.yml")
    tmpl = DEPLOY / "local" / "prometheus.yml.tmpl"
    out += _static(tmpl, tmpl.read_text().format(
        scrape_interval="2s", rule_files="  - a.yml", alertmanager="127.0.0.1:1",
        am_user="u", am_password_file="/p", agents='["127.0.0.1:2"]', remediation="127.0.0.1:3"))
    vm = DEPLOY / "victoriametrics" / "vmagent.yml"
    out += _static(vm, vm.read_text().replace("%{CLUSTERPULSE_SHARDS}", "2")
                   .replace("%{CLUSTERPULSE_SHARD}", "0"))
    (pm,) = [d for d in yaml.safe_load_all((DEPLOY / "kubernetes" / "base" / "agent.yaml")
                                           .read_text()) if d and d["kind"] == "PodMonitor"]
    main, progress = pm["spec"]["podMetricsEndpoints"]
    assert (progress["path"], progress["interval"], progress["port"]) == \
        ("/metrics/progress", "1s", main["port"])
    assert {"targetLabel": "job", "replacement": "rank-progress"} in progress["relabelings"]
    # the one rule that drops whole series (the others restore the GPU owner's labels)
    (drop,) = [r for r in main["metricRelabelings"] if r.get("action") == "drop"]
    assert drop["sourceLabels"] == ["__name__"]
    return [*out, ("kubernetes PodMonitor", drop["regex"])]


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> set[str]:
    """Every sample name the agent exports with a rank that reported all it can."""
    from tests.conftest import start_agent

    running, server = start_agent(tmp_path_factory.mktemp("agent"))
    try:
        with RankProcess(running.socket_path, [
                {"type": "step", "run": "r", "rank": 0, "local_rank": 0, "gpu": 0,
                 "world_size": 1, "step": 1, "step_seconds": 0.1,
                 "collectives_entered_total": 3, "collectives_completed_total": 2},
                {"type": "heartbeat", "run": "r", "rank": 0, "phase": "sync",
                 "collective": "all_reduce", "collectives_entered_total": 3,
                 "collectives_completed_total": 2}]):
            body = requests.get(running.url + "/metrics", timeout=5).text
    finally:
        server.shutdown()
        running.agent.stop()
    return {s.name for fam in text_string_to_metric_families(body) for s in fam.samples}


@pytest.mark.parametrize("where,regex", _configs())
def test_the_main_scrape_drops_exactly_the_progress_families(where, regex, exported):
    assert set(PROGRESS_FAMILIES) <= exported
    dropped = {n for n in exported if re.fullmatch(regex, n)}  # Prometheus anchors it
    assert dropped == set(PROGRESS_FAMILIES), (where, dropped ^ set(PROGRESS_FAMILIES))
