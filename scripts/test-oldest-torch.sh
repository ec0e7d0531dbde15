#!/usr/bin/env bash
# The trainer and instrumentation tests on the oldest torch ClusterPulse supports
# (clusters run the torch of their container images, not the newest). Builds
# .venv-torch-oldest once (torch from PyPI: its CUDA build, ~5 GB, as PyPI has no CPU
# build of it; TORCH_OLDEST_INDEX=URL takes it from another index, e.g. a CPU one),
# then runs the tests (two files at a time; `-n 1` for one). scripts/test.sh builds it
# and runs these tests in the background, one file at a time, beside the main suite.
#   scripts/test-oldest-torch.sh            build if needed, then test
#   scripts/test-oldest-torch.sh --prepare  build only
#   scripts/test-oldest-torch.sh -k async   extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."

# The oldest supported release: pyproject's torch>= and trainer/torch_support.OLDEST
# say the same (tests/unit/test_torch_support.py).
TORCH_OLDEST=${TORCH_OLDEST:-2.6.0}
venv=.venv-torch-oldest
say() { printf 'oldest torch: %s\n' "$*"; }

stamp=$venv/.clusterpulse-installed
want=$(printf '%s\n' "$TORCH_OLDEST" | cat - pyproject.toml "$0" | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  say "installing torch $TORCH_OLDEST into $venv"
  rm -rf "$venv"
  python3 -m venv "$venv"
  index=()
  [ -n "${TORCH_OLDEST_INDEX:-}" ] && index=(--index-url "$TORCH_OLDEST_INDEX")
  # No cache and no byte-compiling: this runs beside the main suite (scripts/test.sh),
  # and a cached copy of the ~5 GB download is as many GB more written to its disk,
  # the compiling CPU time taken from its tests; Python compiles what is imported.
  "$venv/bin/pip" install -q --no-cache-dir --no-compile "${index[@]}" "torch==$TORCH_OLDEST" \
    2> >(grep -v "is ignored: it is neither" >&2)
  # the trainer's runtime dependencies and the test tools these tests use; the project
  # itself from this checkout (no build: its package is the repository's root)
  "$venv/bin/pip" install -q --no-cache-dir --no-compile "numpy>=1.24" \
    "prometheus-client>=0.20" "nvidia-ml-py>=12.535" \
    "requests>=2.31" "pytest>=8" "pytest-xdist>=3.6" "pyyaml>=6" "hypothesis>=6.100" \
    2> >(grep -v "is ignored: it is neither" >&2)
  "$venv/bin/python" - <<'PY'
import pathlib, site
pathlib.Path(site.getsitepackages()[0], "clusterpulse-checkout.pth").write_text(
    str(pathlib.Path.cwd()) + "\n")
PY
  echo "$want" > "$stamp"
fi
[ "${1:-}" = "--prepare" ] && exit 0

got=$("$venv/bin/python" -c 'import torch; print(torch.__version__)')
say "testing the trainer and the instrumentation on torch $got"
# The parts that touch torch's APIs: checkpoints (DCP, the stager), the launcher and
# rendezvous patches, Pulse and its hooks (DDP, collectives, compile), the recipe's
# data position, and real torchrun jobs (a world of one, DDP and FSDP telemetry, the
# port a round's store is on, a checkpoint written by the main venv's torch resumed
# here and back).
exec "$venv/bin/python" -m pytest -n 2 --dist loadfile --no-loadscope-reorder -p no:cacheprovider \
  tests/unit/test_torch_support.py tests/unit/test_async_checkpoint.py \
  tests/unit/test_trainer_parts.py tests/unit/test_torchrun.py \
  tests/unit/test_collective_timing.py tests/unit/test_instrument_calls.py \
  tests/unit/test_pulse_compile.py tests/unit/test_trainer_dtype.py \
  tests/unit/test_resume_data.py tests/unit/test_telemetry.py \
  tests/integration/test_world_of_one.py tests/integration/test_trainer_telemetry.py \
  tests/integration/test_checkpoint_across_torch.py \
  "tests/integration/test_clean_start.py::test_one_nodes_ranks_meet_on_a_port_no_other_process_is_handed" \
  "$@"
