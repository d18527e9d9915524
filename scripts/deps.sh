#!/usr/bin/env bash
# Installs what mgpu's build, lint and tests need. Idempotent and cached:
# Go tools go to $CACHE_DIR/bin (default /var/cache/mgpu/bin); Debian
# packages are installed only when missing (needs root; without root the
# tests that need them skip with a reason).
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE_DIR=${CACHE_DIR:-/var/cache/mgpu}
GOLANGCI_VERSION=v2.6.2
mkdir -p "$CACHE_DIR/bin"

have_lint() {
  [ -x "$CACHE_DIR/bin/golangci-lint" ] &&
    "$CACHE_DIR/bin/golangci-lint" version 2>/dev/null | grep -q "${GOLANGCI_VERSION#v}"
}
if ! have_lint; then
  echo "deps: installing golangci-lint $GOLANGCI_VERSION into $CACHE_DIR/bin"
  (cd /tmp && GOBIN="$CACHE_DIR/bin" GOFLAGS=-buildvcs=false \
    go install "github.com/golangci/golangci-lint/v2/cmd/golangci-lint@$GOLANGCI_VERSION")
fi

# Container test dependencies (podman, runc, containerd 2.x).
if [ -x test/e2e/deps.sh ]; then
  test/e2e/deps.sh
fi
