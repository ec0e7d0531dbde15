#!/usr/bin/env bash
# Installs everything ClusterPulse needs on a fresh Debian/Ubuntu machine:
# Debian's prometheus, prometheus-alertmanager, chromium and libatomic1 (Playwright's
# driver needs it), then a virtual environment (.venv) with the project and its test
# tools. Safe to re-run: it skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf 'setup: %s\n' "$*"; }
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

missing=()
command -v prometheus >/dev/null || missing+=(prometheus)
command -v prometheus-alertmanager >/dev/null || missing+=(prometheus-alertmanager)
command -v chromium >/dev/null || missing+=(chromium)
command -v openssl >/dev/null || missing+=(openssl)  # test certificates (TLS tests)
python3 -c 'import ensurepip, venv' 2>/dev/null || missing+=(python3-venv)
# Playwright's bundled Node.js driver links libatomic, which a minimal Debian lacks.
dpkg-query -W -f='${Status}' libatomic1 2>/dev/null | grep -q 'ok installed' \
  || missing+=(libatomic1)
# The deploy tests check the systemd units with systemd-analyze (no running systemd needed).
command -v systemd-analyze >/dev/null || missing+=(systemd)
# The image tests build with buildah from a debootstrap base (no registry needed).
command -v buildah >/dev/null || missing+=(buildah)
command -v debootstrap >/dev/null || missing+=(debootstrap)
# VictoriaMetrics, vmagent and vmalert (one Debian package, victoria-metrics): the path
# past one machine (deploy/victoriametrics/), its test (sharded vmagent scrapes, rules
# on vmalert) and the fleet benchmark (make bench-fleet).
for vm in victoria-metrics vmagent vmalert; do
  command -v "$vm" >/dev/null || { missing+=(victoria-metrics); break; }
done
# The multi-node testbed's network namespaces, veths, bridge and tbf (deploy/testbed/).
command -v ip >/dev/null && command -v tc >/dev/null || missing+=(iproute2)
# The Prometheus host's egress filter (deploy/systemd/clusterpulse-egress, its test).
command -v iptables >/dev/null || missing+=(iptables)
# A real Slurm for the testbed's scheduler tests (deploy/testbed/slurm.py).
command -v slurmctld >/dev/null || missing+=(slurm-wlm)
command -v munged >/dev/null || missing+=(munge)
if [ ${#missing[@]} -gt 0 ]; then
  say "installing Debian packages: ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get -o DPkg::Lock::Timeout=900 install -y -qq \
    --no-install-recommends \
    "${missing[@]}" >/dev/null
  # Debian's packages start system services where systemd runs; ours use their own ports.
fi

python3 - <<'PY' || { echo "setup: Python >= 3.11 is required" >&2; exit 1; }
import sys
sys.exit(0 if sys.version_info >= (3, 11) else 1)
PY

if [ ! -x .venv/bin/python ]; then
  say "creating .venv"
  python3 -m venv .venv
fi
stamp=.venv/.clusterpulse-installed
want=$(sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  # A CPU build of torch first, so that resolving the project never pulls a CUDA build
  # of several GB onto a machine without a GPU. On GPU machines set TORCH_SPEC/TORCH_INDEX.
  # --no-compile: byte-compiling every module of every package took 35 s of the 90 s
  # set-up here (torch alone 13 s); Python compiles the modules that are imported, once.
  if ! .venv/bin/python -c 'import torch' 2>/dev/null; then
    say "installing torch (CPU build)"
    if [ -n "${TORCH_INDEX:-}" ]; then
      .venv/bin/pip install -q --no-compile "${TORCH_SPEC:-torch}" --index-url "$TORCH_INDEX"
    elif ! .venv/bin/pip install -q --no-compile "${TORCH_SPEC:-torch==2.13.0}" 2>/dev/null; then
      .venv/bin/pip install -q --no-compile torch --index-url https://download.pytorch.org/whl/cpu
    fi
  fi
  say "installing clusterpulse and its test tools into .venv"
  .venv/bin/pip install -q --no-compile -e '.[all,dev]' \
    2> >(grep -v "is ignored: it is neither" >&2)
  echo "$want" > "$stamp"
fi
say "ready: $(.venv/bin/python --version), $(prometheus --version 2>&1 | head -n1)"
