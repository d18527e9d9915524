#!/usr/bin/env bash
# Installs what mgpu's build, lint and tests need. Idempotent and cached:
# Go tools go to $CACHE_DIR/bin (default /var/cache/mgpu/bin); Debian
# packages are installed only when missing (needs root; without root the
# tests that need them skip with a reason).
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE_DIR=${CACHE_DIR:-/var/cache/mgpu}
GOLANGCI_VERSION=v2.6.2
HELM_VERSION=v4.3.2
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

# helm, for the chart's tests (test/chart: helm lint and helm template).
# `go install` sets no release version, so the build is given it: without
# it `helm version --short` says only "v4.3".
have_helm() {
  [ -x "$CACHE_DIR/bin/helm" ] &&
    [ "$("$CACHE_DIR/bin/helm" version --short 2>/dev/null)" = "$HELM_VERSION" ]
}
if ! have_helm; then
  echo "deps: installing helm $HELM_VERSION into $CACHE_DIR/bin"
  (cd /tmp && GOBIN="$CACHE_DIR/bin" GOFLAGS=-buildvcs=false \
    go install -ldflags "-X helm.sh/helm/v4/internal/version.version=$HELM_VERSION" \
    "helm.sh/helm/v4/cmd/helm@$HELM_VERSION")
fi

# Packaging test dependencies: rpm (rpm -qlp), systemd (systemd-analyze
# verify; installing it does not make it PID 1, it only brings the tools),
# and, for the upgrade under a running systemd, systemd-container
# (systemd-nspawn boots a Debian tree) and mmdebstrap (builds that tree).
missing=""
for pkg in rpm systemd systemd-container mmdebstrap; do
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

# Observability test dependencies: Debian's prometheus (test/process scrapes
# `mgpu-cli metrics serve` with it) and tmux (mgpu-cli top in a terminal).
# Installed without recommends and with services kept from starting: the
# tests run their own prometheus on loopback.
missing=""
for pkg in prometheus tmux; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' || missing="$missing $pkg"
done
if [ -n "$missing" ]; then
  if [ "$(id -u)" -eq 0 ]; then
    echo "deps: apt-get install --no-install-recommends$missing"
    policy=""
    if [ ! -e /usr/sbin/policy-rc.d ]; then
      printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d && policy=1
    fi
    # shellcheck disable=SC2086 # the package list is split on purpose
    rc=0
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $missing >/dev/null ||
      { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $missing >/dev/null; } ||
      rc=$?
    [ -z "$policy" ] || rm -f /usr/sbin/policy-rc.d
    [ "$rc" -eq 0 ] || exit "$rc"
  else
    echo "deps: not root, skipping$missing (the tests that need them skip)"
  fi
fi

# The Debian 12 tree with systemd that test/packaging boots with
# systemd-nspawn, built once (about 20 s and 190 MiB) and kept as a tarball.
ROOTFS_TAR="$CACHE_DIR/systemd-rootfs-bookworm.tar"
if [ ! -f "$ROOTFS_TAR" ] && [ "$(id -u)" -eq 0 ] && command -v mmdebstrap >/dev/null; then
  echo "deps: mmdebstrap bookworm (systemd) into $ROOTFS_TAR"
  tmp="$CACHE_DIR/.systemd-rootfs-bookworm.partial.tar" # mmdebstrap: the format from the name
  rm -rf "$tmp"
  if mmdebstrap --quiet --format=tar --variant=minbase --include=systemd,systemd-sysv,dbus bookworm "$tmp" \
      http://deb.debian.org/debian && [ -f "$tmp" ]; then
    mv "$tmp" "$ROOTFS_TAR"
  else
    rm -rf "$tmp"
    echo "deps: mmdebstrap failed; the packaging test under systemd will say so" >&2
  fi
fi

# Container test dependencies (podman, runc, containerd 2.x).
if [ -x test/e2e/deps.sh ]; then
  test/e2e/deps.sh
fi

# Kubernetes test dependencies (etcd, CNI plugins, and the Kubernetes
# components built from source: about 12 minutes cold, then cached).
if [ -x test/k8s/deps.sh ]; then
  if [ "$(id -u)" -eq 0 ]; then
    test/k8s/deps.sh
  else
    echo "deps: not root, skipping test/k8s/deps.sh (test/k8s skips)"
  fi
fi
