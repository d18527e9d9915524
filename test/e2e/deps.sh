#!/bin/sh
# Installs what the container tests (test/e2e) need, idempotently:
#   - Debian's runc, podman (4.3 on Debian 12) and busybox-static (the
#     containers' root filesystem);
#   - containerd 2.x, ctr and containerd-shim-runc-v2, built from containerd's
#     Go module (Debian's containerd 1.6 has no CDI) into a cache directory;
#   - the Docker engine (dockerd) built from moby's Go module into the same
#     cache (the docker CLI must be on PATH already).
# Reruns do nothing when everything is there. Needs root for apt-get.
#
#   MGPU_E2E_CACHE       cache directory (default /var/cache/mgpu-e2e);
#                        binaries land in $MGPU_E2E_CACHE/bin
#   CONTAINERD_VERSION   containerd module version (default v2.4.2)
#   DOCKERD_VERSION      github.com/moby/moby/v2 version (default v2.0.0-beta.24)
#
# The tests find containerd in $MGPU_E2E_CACHE/bin (or $MGPU_CONTAINERD, or
# PATH), dockerd there too (or $MGPU_DOCKERD, or PATH).
set -eu

CACHE=${MGPU_E2E_CACHE:-/var/cache/mgpu-e2e}
CONTAINERD_VERSION=${CONTAINERD_VERSION:-v2.4.2}
BIN=$CACHE/bin

log() { printf 'deps.sh: %s\n' "$*" >&2; }

# --- Debian packages -------------------------------------------------------
missing=""
for pkg in runc podman busybox-static; do
	if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed'; then
		missing="$missing $pkg"
	fi
done
if [ -n "$missing" ]; then
	if [ "$(id -u)" -ne 0 ]; then
		log "need root to install:$missing"
		exit 1
	fi
	# Update the package lists once: only when there are none yet, or when
	# an install from the present ones fails.
	if [ -z "$(ls -A /var/lib/apt/lists 2>/dev/null | grep -v -e '^lock$' -e '^partial$' || true)" ]; then
		log "apt-get update"
		apt-get update -q
	fi
	log "apt-get install$missing"
	# shellcheck disable=SC2086 # word splitting of the package list is intended
	if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q $missing; then
		apt-get update -q
		# shellcheck disable=SC2086
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q $missing
	fi
else
	log "runc, podman, busybox-static: installed"
fi

# --- containerd 2.x from its Go module -------------------------------------
want="${CONTAINERD_VERSION#v}"
have=""
if [ -x "$BIN/containerd" ] && [ -x "$BIN/ctr" ] && [ -x "$BIN/containerd-shim-runc-v2" ]; then
	# "containerd github.com/containerd/containerd/v2 2.4.2+unknown "
	have=$("$BIN/containerd" --version 2>/dev/null | awk '{print $3}' | sed 's/^v//; s/+.*//')
fi
if [ "$have" = "$want" ]; then
	log "containerd $want: $BIN"
else
	command -v go >/dev/null || { log "go is needed to build containerd"; exit 1; }
	log "building containerd $CONTAINERD_VERSION into $BIN (a few minutes)"
	mkdir -p "$BIN"
	GOBIN=$BIN GOFLAGS=-buildvcs=false go install \
		"github.com/containerd/containerd/v2/cmd/containerd@$CONTAINERD_VERSION" \
		"github.com/containerd/containerd/v2/cmd/ctr@$CONTAINERD_VERSION" \
		"github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2@$CONTAINERD_VERSION"
	"$BIN/containerd" --version >&2
fi

# --- Docker engine (dockerd) from its Go module -----------------------------
# The docker CLI comes with the machine image (28.2.2 here; CDI device names
# need a CLI of Docker 25+): only the engine is built.
DOCKERD_VERSION=${DOCKERD_VERSION:-v2.0.0-beta.24}
have=""
if [ -x "$BIN/dockerd" ]; then
	# "	mod	github.com/moby/moby/v2	v2.0.0-beta.24	h1:..."
	have=$(go version -m "$BIN/dockerd" 2>/dev/null | awk '$1 == "mod" && $2 == "github.com/moby/moby/v2" {print $3}')
fi
if [ "$have" = "$DOCKERD_VERSION" ]; then
	log "dockerd $DOCKERD_VERSION: $BIN"
else
	command -v go >/dev/null || { log "go is needed to build dockerd"; exit 1; }
	log "building dockerd $DOCKERD_VERSION into $BIN (about 2 minutes)"
	mkdir -p "$BIN"
	GOBIN=$BIN GOFLAGS=-buildvcs=false go install "github.com/moby/moby/v2/cmd/dockerd@$DOCKERD_VERSION"
fi
if ! command -v docker >/dev/null; then
	log "the docker CLI (Docker 25 or newer) is not on PATH: install it (e.g. Docker's docker-ce-cli package)"
	exit 1
fi
log "docker CLI: $(docker --version)"
