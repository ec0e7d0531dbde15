#!/usr/bin/env bash
# The test command: installs what is missing, lints, then runs the whole suite
# (unit, integration with real Prometheus/Alertmanager/torchrun, browser end-to-end),
# and, beside it, the trainer and instrumentation tests again on the oldest supported torch
# (scripts/test-oldest-torch.sh: its venv is built, then its tests run, beside the main
# suite).
# Extra arguments go to pytest and run that selection only, on the main venv, e.g.
# `scripts/test.sh -m "not slow"`. Two test files run at a time (a file's tests stay
# together: they share their module's stack or testbed); PYTEST_WORKERS=0 runs
# everything in this one process, e.g. to debug.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check --quiet .
mkdir -p artifacts
workers=${PYTEST_WORKERS:-2}
if [ "$workers" = 0 ]; then
  exec .venv/bin/python -m pytest "$@"
fi
if [ $# -gt 0 ]; then
  exec .venv/bin/python -m pytest -n "$workers" --dist loadfile "$@"
fi
# The oldest torch's tests run beside the main suite once their venv is built (mostly a
# download), in one process: the main suite leaves about a fifth of the two cores idle
# (its tests wait on the processes they start), which they take, where they ran for two
# minutes after it and the whole took 30 minutes. Their output follows the main suite's.
(
  scripts/test-oldest-torch.sh --prepare > artifacts/oldest-torch-setup.log 2>&1 || exit 99
  OLDEST_TORCH_WORKERS=0 scripts/test-oldest-torch.sh > artifacts/oldest-torch.log 2>&1
) &
oldest=$!
status=0
.venv/bin/python -m pytest -n "$workers" --dist loadfile || status=$?
oldest_status=0
wait "$oldest" || oldest_status=$?
if [ "$oldest_status" = 99 ]; then
  echo "test: the oldest torch's venv could not be built:" >&2
  tail -n 20 artifacts/oldest-torch-setup.log >&2
  exit 1
fi
cat artifacts/oldest-torch.log
exit $((status ? status : oldest_status))
