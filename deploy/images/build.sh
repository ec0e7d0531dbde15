#!/usr/bin/env bash
# Build the ClusterPulse images with buildah, without any container registry:
#   deploy/images/build.sh agent              # localhost/clusterpulse-agent:<version>
#   deploy/images/build.sh dashboard          # localhost/clusterpulse-dashboard:<version>
#   deploy/images/build.sh base               # only the base image
# The base is a Debian bookworm minbase root (debootstrap) with python3, imported as
# localhost/clusterpulse-base:bookworm-iproute2 and reused while it exists (`buildah rmi` it to
# rebuild). The project and its dependencies go in as wheels built here, so the image
# build itself needs no network. Then push wherever you like:
#   buildah push localhost/clusterpulse-agent:0.1.0 docker://registry.example.com/clusterpulse-agent:0.1.0
# Environment: BASE (base image name), MIRROR (Debian mirror; default: this machine's
# apt source, else deb.debian.org), PYTHON (builds the wheels; default .venv/bin/python),
# ISOLATION (buildah isolation; default chroot, which works without user namespaces).
set -euo pipefail
cd "$(dirname "$0")/../.."

usage() { sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; }
case "${1:-}" in
  agent|dashboard|base) what=$1 ;;
  -h|--help) usage; exit 0 ;;
  *) usage >&2; echo "build.sh: error: say which image: agent, dashboard or base" >&2; exit 2 ;;
esac
command -v buildah >/dev/null || { echo "build.sh: error: buildah is not installed (apt-get install buildah)" >&2; exit 2; }

BASE=${BASE:-localhost/clusterpulse-base:bookworm-iproute2}
ISOLATION=${ISOLATION:-chroot}
PYTHON=${PYTHON:-.venv/bin/python}
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
say() { printf 'build.sh: %s\n' "$*" >&2; }

base_image() {
  if buildah inspect --type image "$BASE" >/dev/null 2>&1; then return; fi
  command -v debootstrap >/dev/null || { echo "build.sh: error: debootstrap is not installed" >&2; exit 2; }
  local mirror=${MIRROR:-}
  # (either file may be missing: a debootstrap root has only sources.list)
  [ -n "$mirror" ] || mirror=$(sed -n 's/^URIs: *\([^ ]*\/debian\)$/\1/p' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -n 1 || true)
  [ -n "$mirror" ] || mirror=$(awk '$1 == "deb" && $2 !~ /security/ {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
  [ -n "$mirror" ] || mirror=http://deb.debian.org/debian
  local root
  root=$(mktemp -d)
  trap 'rm -rf "$root"' RETURN
  # iproute2: the agent reads its NICs' queue statistics with `tc`.
  say "debootstrap bookworm minbase + python3 + iproute2 from $mirror (once; a few minutes)"
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,iproute2 \
    bookworm "$root" "$mirror" >"$root.log" 2>&1 || { tail -n 20 "$root.log" >&2; exit 1; }
  rm -f "$root.log"
  # Slim: no apt lists, caches, docs or man pages in the image.
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/* "$root"/usr/share/doc/* \
    "$root"/usr/share/man/* "$root"/usr/share/locale/* "$root"/var/log/*
  local ctr
  ctr=$(buildah from scratch)
  buildah copy --quiet "$ctr" "$root" / >/dev/null
  buildah config --env PATH=/usr/sbin:/usr/bin:/sbin:/bin --env LANG=C.UTF-8 "$ctr"
  buildah commit --quiet --rm "$ctr" "$BASE" >/dev/null
  say "base image $BASE ready"
}

base_image
[ "$what" = base ] && exit 0

ctx=$(mktemp -d)
trap 'rm -rf "$ctx"' EXIT
src=$PWD
# The agent's image can ask the kubelet which pod holds each GPU (--pod-resources, gRPC).
[ "$what" = agent ] && src="$PWD[kubernetes]"
[ "$what" = dashboard ] && src="$PWD[dashboard]"
say "building wheels for $src and its dependencies"
"$PYTHON" -m pip wheel -q -w "$ctx/wheels" "$src" 2> >(grep -v "is ignored: it is neither" >&2)
image=localhost/clusterpulse-$what:$VERSION
say "buildah bud ($ISOLATION) -> $image"
buildah bud --quiet --isolation "$ISOLATION" --build-arg "BASE=$BASE" \
  -f "deploy/images/$what.Containerfile" -t "$image" "$ctx" >/dev/null
echo "$image"
