#!/usr/bin/env bash
# The test command: installs what is missing, lints, then runs the whole suite
# (unit, integration with real Prometheus/Alertmanager/torchrun, browser end-to-end),
# then the trainer and instrumentation tests again on the oldest supported torch
# (scripts/test-oldest-torch.sh; its venv is built in the background meanwhile, which
# mostly waits on the download).
# Extra arguments go to pytest and run that selection only, on the main venv, e.g.
# `scripts/test.sh -m "not slow"`. Three test files run at a time (a file's tests stay
# together: they share their module's stack or testbed; most files wait on alerts'
# `for`, restarts and rendezvous more than on the CPU: on 2 cores three at a time took
# 1,376 s where two took 1,550); PYTEST_WORKERS=0 runs everything in this one
# process, e.g. to debug.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check --quiet .
mkdir -p artifacts
workers=${PYTEST_WORKERS:-3}
if [ "$workers" = 0 ]; then
  exec .venv/bin/python -m pytest "$@"
fi
if [ $# -gt 0 ]; then
  exec .venv/bin/python -m pytest -n "$workers" --dist loadfile "$@"
fi
# At the lowest CPU priority: its ~80 s of CPU (unpacking ~8 GB of wheels) falls in the
# first minutes, beside the longest test files, which start first (on a fresh machine
# the main suite took 1,607 s at the same priority; here, with the venv built, 1,376 s).
nice -n 19 scripts/test-oldest-torch.sh --prepare > artifacts/oldest-torch-setup.log 2>&1 &
prepare=$!
status=0
.venv/bin/python -m pytest -n "$workers" --dist loadfile || status=$?
if ! wait "$prepare"; then
  echo "test: the oldest torch's venv could not be built:" >&2
  tail -n 20 artifacts/oldest-torch-setup.log >&2
  exit 1
fi
scripts/test-oldest-torch.sh || status=$((status ? status : $?))
exit "$status"
