"""Console-script entry points of the commands that need an optional extra.

The bare ``pip install clusterpulse`` is the node agent (NVML + the Prometheus client);
the trainer needs torch, the dashboard, ctl, remediation and detection need the
dashboard extra. On an agent-only node those commands are still on PATH, and without
this wrapper each one dies in its imports with a ModuleNotFoundError traceback that
names a module, not what to install. Each entry here imports its command and runs it,
and turns a missing optional dependency - at import or later, from a lazy import -
into one line naming the extra. Any other missing module is a bug and is raised.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

# Import names of the optional dependencies ([project.optional-dependencies] trainer
# and dashboard in pyproject.toml; a unit test keeps the two in step).
OPTIONAL = frozenset({"bcrypt", "numpy", "pandas", "requests", "streamlit", "torch"})


def run(prog: str, target: str, extra: str) -> int:
    """Run `target` ("module:function"); a missing optional module is one line, exit 2."""
    module, _, func = target.partition(":")
    try:
        main: Callable[[], int | None] = getattr(importlib.import_module(module), func)
        return main() or 0
    except ModuleNotFoundError as err:
        if (err.name or "").partition(".")[0] not in OPTIONAL:
            raise
        print(f"{prog} needs the {extra} extra: pip install 'clusterpulse[{extra}]'",
              file=sys.stderr)
        return 2


def train() -> int:
    return run("clusterpulse-train", "clusterpulse.trainer.launch:main", "trainer")


def dashboard() -> int:
    return run("clusterpulse-dashboard", "clusterpulse.dashboard.cli:main", "dashboard")


def ctl() -> int:
    return run("clusterpulse-ctl", "clusterpulse.dashboard.ctl:main", "dashboard")


def remediate() -> int:
    return run("clusterpulse-remediate", "clusterpulse.dashboard.remediation:main", "dashboard")


def detect() -> int:
    return run("clusterpulse-detect", "clusterpulse.detection.cli:main", "dashboard")
