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

# Packaging test dependencies: rpm (rpm -qlp) and systemd (systemd-analyze
# verify). Installing systemd does not make it PID 1; it only brings the tools.
missing=""
for pkg in rpm systemd; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' || missing="$missing $pkg"
done
if [ -n "$missing" ]; then
  if [ "$(id -u)" -eq 0 ]; then
    echo "deps: apt-get install$missing"
    # shellcheck disable=SC2086 # the package list is split on purpose
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q $missing >/dev/null ||
      { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $missing >/dev/null; }
  else
    echo "deps: not root, skipping$missing (the tests that need them skip)"
  fi
fi

# Container test dependencies (podman, runc, containerd 2.x).
if [ -x test/e2e/deps.sh ]; then
  test/e2e/deps.sh
fi
