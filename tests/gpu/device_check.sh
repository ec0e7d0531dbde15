#!/usr/bin/env bash
# The GPU machine's one check (issue #26): versions, tests/gpu, the async-checkpoint tests
# on this machine's torch, and every GPU figure (tests/bench/bench_gpu.py). Everything
# printed also goes to $OUT/device.log.
#
#   OUT=/some/folder bash tests/gpu/device_check.sh       # from the repository root
#   PYTHON=/opt/torch/.venv/bin/python3 OUT=... bash tests/gpu/device_check.sh
#
# Needs python3 with torch, pytest, nvidia-ml-py, prometheus-client, numpy and pyyaml
# (no requests, Streamlit or Playwright). About 8 minutes at most: each part has its own
# time limit, and a part that fails or runs out of time does not stop the next one.
# Exit status: how many parts failed (0: all passed).
set -u
if [ ! -f tests/gpu/device_check.sh ]; then
    echo "device_check: run it from the repository root" >&2
    exit 2
fi
OUT=${OUT:?set OUT to the folder that receives device.log}
mkdir -p "$OUT"
exec > >(tee "$OUT/device.log") 2>&1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
failed=0

part() {  # part NAME SECONDS COMMAND...: run with a time limit, say how it ended
    local name=$1 limit=$2 t0 rc
    shift 2
    echo
    echo "=== $name (limit ${limit} s) ==="
    t0=$(date +%s)
    timeout -k 10 "$limit" "$@"
    rc=$?
    [ "$rc" -eq 124 ] && echo "($name ran out of its ${limit} s)"
    echo "=== $name: exit $rc after $(( $(date +%s) - t0 )) s ==="
    [ "$rc" -eq 0 ] || failed=$((failed + 1))
}

echo "device_check: $(date -u +%FT%TZ) on $(hostname)"
part versions 60 bash -c "
    nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv
    $PY -c 'import sys, torch
print(\"python\", sys.version.split()[0])
print(\"torch\", torch.__version__, \"CUDA\", torch.version.cuda, \"cuDNN\", torch.backends.cudnn.version())
print(\"GPUs\", torch.cuda.device_count(), [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
print(\"NCCL\", torch.cuda.nccl.version() if torch.cuda.is_available() else None)
import pynvml, prometheus_client
print(\"nvidia-ml-py\", getattr(pynvml, \"__version__\", \"?\"))'"
part "pytest tests/gpu" 200 "$PY" -m pytest -q -p no:cacheprovider tests/gpu
part "async checkpoints on this torch" 100 \
    "$PY" -m pytest -q -p no:cacheprovider tests/unit/test_async_checkpoint.py
part "bench_gpu" 330 "$PY" -m tests.bench.bench_gpu --budget-s 260
echo
echo "device_check: $failed part(s) failed; log in $OUT/device.log"
exit "$failed"
