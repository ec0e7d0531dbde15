#!/usr/bin/env bash
# The test command: installs what is missing, lints, then runs the whole suite
# (unit, integration with real Prometheus/Alertmanager/torchrun, browser end-to-end),
# then the trainer and instrumentation tests again on the oldest supported torch
# (scripts/test-oldest-torch.sh; its venv is built in the background meanwhile, which
# mostly waits on the download).
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
# At the lowest CPU priority: its ~80 s of CPU (unpacking ~8 GB of wheels) is for later,
# the tests' is for now (the two workers leave about a quarter of the CPU idle, waiting
# on alerts' `for`, restarts and rendezvous). Three workers were tried on a fresh
# machine: the main suite took 1,607 s and 1,628 s, and 1,603 s with two the same
# evening (1,463-1,556 s earlier that day): no gain to show for the added load.
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
