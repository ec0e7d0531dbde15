"""The dashboard in a real browser: a real Streamlit server (clusterpulse-dashboard),
driven by Playwright in Debian's headless Chromium, over a real stack (agents,
Prometheus, Alertmanager) and a real two-node torchrun job. Screenshots go to
artifacts/."""

from __future__ import annotations

import json
import os
import sys

import pytest
import requests

from clusterpulse.dashboard.auth import hash_password
from tests.support.ports import free_port
from tests.support.procs import REPO, Proc, wait_until
from tests.support.stack import Stack

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
ARTIFACTS = REPO / "artifacts"
PASSWORD = "e2e-operator-password"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("browser")
    stack = Stack.start(tmp)
    dash = None
    try:
        stack.start_job("web", steps=100000, trainer_args=[
            "--sim-compute-seconds", "0.1", "--ckpt-every", "20",
            "--inject", "slow:rank=3:step=1:factor=1.8"])
        ops = tmp / "operators.toml"
        ops.write_text(f'[operators]\nops = "{hash_password(PASSWORD)}"\n')
        port = free_port()
        dash = Proc([sys.executable, "-m", "clusterpulse.dashboard.cli",
                     "--prometheus", stack.prom.url,
                     "--alertmanager", stack.am.url, "--port", str(port), "--token-file",
                     str(tmp / "token"), "--operators-file", str(ops), "--audit-log",
                     str(tmp / "audit.jsonl"), "--refresh", "2"], tmp / "dashboard.log",
                    cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: requests.get(url + "/_stcore/health", timeout=1).ok, 60, "dashboard")
        wait_until(lambda: len(stack.prom.query('clusterpulse_trainer_step{run="web"}')) == 4, 120,
                   "4 ranks of run web")
        from playwright.sync_api import sync_playwright

        ARTIFACTS.mkdir(exist_ok=True)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
            yield {"stack": stack, "url": url, "browser": browser, "tmp": tmp}
            browser.close()
    finally:  # also when a wait above fails: no process may outlive the module
        if dash is not None:
            dash.stop()
        stack.stop()


def page(env):
    p = env["browser"].new_page(viewport={"width": 1400, "height": 1100})
    p.set_default_timeout(60_000)
    return p


def test_cluster_page_shows_live_data(env):
    p = page(env)
    p.goto(env["url"])
    p.get_by_text("Nodes up").wait_for()
    p.get_by_text("2 / 2", exact=True).wait_for()
    p.get_by_text("8 / 8", exact=True).wait_for()
    p.get_by_text("Utilization (%) by node x GPU").wait_for()
    p.screenshot(path=ARTIFACTS / "cluster.png", full_page=True)


def test_straggler_is_flagged_with_its_cause_and_viewers_cannot_act(env):
    p = page(env)
    p.goto(env["url"] + "/run")
    p.get_by_text("cause: compute").wait_for(timeout=90_000)
    p.get_by_text("STRAGGLER").first.wait_for()
    p.get_by_text("Viewers are read-only").wait_for()
    assert p.get_by_role("button", name="Request").count() == 0
    p.screenshot(path=ARTIFACTS / "run-straggler.png", full_page=True)


def test_operator_checkpoint_restart_resumes_with_zero_steps_lost(env):
    p = page(env)
    p.goto(env["url"])
    p.get_by_role("textbox", name="Operator").fill("ops")
    p.get_by_role("textbox", name="Password").fill(PASSWORD)
    p.get_by_role("button", name="Sign in").click()
    p.get_by_text("Operator: ops").wait_for()
    p.get_by_role("link", name="Run").click()
    p.get_by_label("Reason (audited)").fill("e2e: straggler on rank 3")
    p.get_by_text("I confirm: restart run web").click()
    p.get_by_role("button", name="Request").click()
    p.get_by_text("All ranks resumed.").wait_for(timeout=180_000)
    p.screenshot(path=ARTIFACTS / "run-restarted.png", full_page=True)
    state = json.loads((env["tmp"] / "web" / "run-state.json").read_text())
    restart = state["restarts"][-1]
    assert restart["cause"] == "checkpoint-restart" and restart["steps_recomputed"] == 0
    audit = [json.loads(x) for x in (env["tmp"] / "audit.jsonl").read_text().splitlines()]
    assert any(r["who"] == "ops" and r["action"] == "checkpoint-restart"
               and r["outcome"] == "accepted" for r in audit)


def test_prometheus_outage_shows_a_banner_then_recovers(env):
    prom = env["stack"].prom
    p = page(env)
    p.goto(env["url"])
    p.get_by_text("2 / 2", exact=True).wait_for()
    prom.proc.stop()
    try:
        p.get_by_text("Prometheus is unavailable").first.wait_for(timeout=60_000)
        p.get_by_text("2 / 2", exact=True).wait_for()  # the last data, marked stale
        p.screenshot(path=ARTIFACTS / "prometheus-down.png", full_page=True)
    finally:
        prom.start()
    p.get_by_text("Prometheus is unavailable").first.wait_for(state="detached", timeout=60_000)
