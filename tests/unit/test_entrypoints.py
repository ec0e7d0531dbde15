"""Every installed command, on an agent-only install (no torch, numpy, requests,
streamlit, pandas): it runs, or says in one line which extra to install - never a
ModuleNotFoundError traceback. Each command's entry point, exactly as pyproject.toml
declares it, runs in a fresh interpreter whose import system refuses the optional
modules, as if they were not installed."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib

import pytest

from clusterpulse.entry import OPTIONAL
from tests.support.procs import REPO

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
SCRIPTS: dict[str, str] = PYPROJECT["project"]["scripts"]
# What each command needs beyond the agent's dependencies (None: nothing).
EXTRA = {"clusterpulse-agent": None, "clusterpulse-config": None,
         "clusterpulse-healthcheck": None, "clusterpulse-audit": None,
         "clusterpulse-csi": None,  # grpc only once it serves: tests/integration/test_csi.py
         "clusterpulse-train": "trainer",
         "clusterpulse-dashboard": "dashboard", "clusterpulse-ctl": "dashboard",
         "clusterpulse-remediate": "dashboard", "clusterpulse-detect": "dashboard"}
AGENT_ONLY = """
import importlib.abc, sys
class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, NotInstalled())
module, _, func = {target!r}.partition(":")
sys.argv = [{prog!r}, *{argv!r}]
raise SystemExit(getattr(importlib.import_module(module), func)())
"""


def test_every_command_is_covered_and_optional_is_the_extras():
    assert set(SCRIPTS) == set(EXTRA)
    extras = PYPROJECT["project"]["optional-dependencies"]
    names = {re.split(r"[<>=\[ ;]", d, maxsplit=1)[0]
             for e in ("trainer", "dashboard") for d in extras[e]}
    assert names == OPTIONAL


@pytest.mark.parametrize("prog", sorted(EXTRA))
def test_command_runs_or_names_its_extra_in_one_line(prog):
    # --help for the agent's commands; the others as an operator starts them (the
    # dashboard's --help needs no streamlit, its start does)
    argv = ["--help"] if EXTRA[prog] is None else []
    code = AGENT_ONLY.format(blocked=sorted(OPTIONAL), target=SCRIPTS[prog], prog=prog,
                             argv=argv)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, cwd=REPO)
    assert "Traceback" not in r.stderr, r.stderr
    extra = EXTRA[prog]
    if extra is None:
        assert r.returncode == 0 and "usage:" in r.stdout, r.stdout + r.stderr
    else:
        assert r.returncode == 2, r.stdout + r.stderr
        assert r.stderr.splitlines() == [
            f"{prog} needs the {extra} extra: pip install 'clusterpulse[{extra}]'"]


def test_a_log_level_that_is_not_one_logs_at_warning_and_says_so():
    """Found by a review: CLUSTERPULSE_LOG_LEVEL=basic_format reached
    getattr(logging, 'BASIC_FORMAT'), a format string, and every rank of the trainer
    died in logging.basicConfig before its first line."""
    r = subprocess.run(
        [sys.executable, "-c", "import logging\n"
         "from clusterpulse.agent.logsetup import setup_logging\n"
         "setup_logging('basic_format', 'CLUSTERPULSE_LOG_LEVEL')\n"
         "logging.getLogger('x').info('not shown')\n"
         "logging.getLogger('x').warning('shown')\n"
         "setup_logging(' INFO ')\n"
         "logging.getLogger('x').info('info shown')\n"],
        cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 3, r.stderr
    assert "CLUSTERPULSE_LOG_LEVEL 'basic_format' is not a log level" in lines[0]
    assert 'msg="shown"' in lines[1] and 'msg="info shown"' in lines[2]
    bad = subprocess.run([sys.executable, "-m", "clusterpulse.dashboard.remediation",
                          "--policy", "x", "--webhook-token-file", "y",
                          "--log-level", "basic_format"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "invalid log_level value: 'basic_format'" in bad.stderr, \
        bad.stderr


@pytest.mark.parametrize(("text", "level"), [("INFO", 20), ("warn", 30), ("Fatal", 50),
                                             ("debug", 10)])
def test_the_level_names_python_takes_are_taken_in_any_case(text, level):
    """A review found the first fix refused what getattr(logging, ...) had taken:
    --log-level INFO and the stdlib's aliases WARN and FATAL."""
    import logging

    from clusterpulse.agent.logsetup import log_level, setup_logging

    setup_logging(text)
    try:
        assert logging.getLogger().level == level
        assert log_level(text) in ("debug", "info", "warning", "critical")
    finally:
        setup_logging("warning")
