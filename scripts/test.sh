#!/usr/bin/env bash
# The test command: installs what is missing, lints, then runs the whole suite
# (unit, integration with real Prometheus/Alertmanager/torchrun, browser end-to-end).
# Extra arguments go to pytest, e.g. `scripts/test.sh -m "not slow"`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check --quiet .
mkdir -p artifacts
exec .venv/bin/python -m pytest "$@"
