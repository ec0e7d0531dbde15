#!/usr/bin/env bash
# The test command: installs what is missing, lints, then runs the whole suite
# (unit, integration with real Prometheus/Alertmanager/torchrun, browser end-to-end).
# Extra arguments go to pytest, e.g. `scripts/test.sh -m "not slow"`. Two test files run
# at a time (a file's tests stay together: they share their module's stack or testbed);
# PYTEST_WORKERS=0 runs everything in this one process, e.g. to debug.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check --quiet .
mkdir -p artifacts
workers=${PYTEST_WORKERS:-2}
if [ "$workers" = 0 ]; then
  exec .venv/bin/python -m pytest "$@"
fi
exec .venv/bin/python -m pytest -n "$workers" --dist loadfile "$@"
