"""promtool, run the one way the tests run it: `check metrics` on an exposition
(what Prometheus's own linter says of the names, types and help), and `test rules`
on a test file or on expressions over input series (the dashboard's and the agents'
PromQL evaluated by the real engine)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path


def _promtool() -> str:
    found = shutil.which("promtool")
    assert found, "promtool is not installed (the test command installs prometheus)"
    return found


def metrics_are_clean(text: str) -> None:
    """`promtool check metrics` accepts the exposition `text` without a word."""
    r = subprocess.run([_promtool(), "check", "metrics"], input=text, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and not (r.stdout + r.stderr).strip(), r.stdout + r.stderr


def rules_pass(test_file: Path | str, cwd: Path | None = None) -> None:
    """`promtool test rules` passes `test_file` (relative to `cwd`, if given)."""
    r = subprocess.run([_promtool(), "test", "rules", str(test_file)], cwd=cwd,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def exprs_pass(tmp_path: Path, interval: str, series: list[dict], exprs: list[dict]) -> None:
    """promtool's verdict on `exprs` (its promql_expr_test entries) over `series`, with
    no rule files, sampled every `interval`."""
    tests = {"rule_files": [], "evaluation_interval": interval, "tests": [{
        "interval": interval, "input_series": series, "promql_expr_test": exprs}]}
    path = tmp_path / "queries.test.yml"
    path.write_text(json.dumps(tests))  # JSON is YAML
    rules_pass(path)
