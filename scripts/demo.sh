#!/usr/bin/env bash
# The main command: installs what is missing, then starts the local cluster demo.
# Arguments go to deploy/local/cluster.py (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python deploy/local/cluster.py "$@"
