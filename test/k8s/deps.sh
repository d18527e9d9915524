#!/bin/sh
# Installs what a single-node Kubernetes cluster of the tests needs,
# idempotently (test/k8s's StartCluster skips without them; containerd comes
# from test/e2e/deps.sh):
#   - Debian's etcd-server (3.4 on Debian 12, which serves kube-apiserver 1.37);
#   - Debian's containernetworking-plugins (bridge, host-local and loopback in
#     /usr/lib/cni, for the pod network);
#   - kube-apiserver, kube-scheduler, kube-controller-manager and kubelet,
#     built from k8s.io/kubernetes into a cache directory.
# Reruns do nothing when everything is there. Needs root for apt-get.
#
#   MGPU_K8S_CACHE       cache directory (default /var/cache/mgpu-k8s);
#                        binaries land in $MGPU_K8S_CACHE/<version>/bin
#   K8S_VERSION          k8s.io/kubernetes version (default v1.37.2)
#
# k8s.io/kubernetes cannot be `go install`ed: its go.mod replaces the
# k8s.io/* staging modules with ./staging/..., which the module zip lacks.
# So the module is downloaded, copied to a writable tree, its replaces are
# pointed at the published staging modules (k8s.io/X v0.<minor>.<patch>),
# and the commands are built there (about 5 minutes on 2 cores, cold).
set -eu

CACHE=${MGPU_K8S_CACHE:-/var/cache/mgpu-k8s}
K8S_VERSION=${K8S_VERSION:-v1.37.2}
BIN=$CACHE/$K8S_VERSION/bin
CMDS="kube-apiserver kube-scheduler kube-controller-manager kubelet"

log() { printf 'k8s deps: %s\n' "$*" >&2; }

# --- etcd ------------------------------------------------------------------
if ! dpkg-query -W -f='${Status}' etcd-server 2>/dev/null | grep -q 'install ok installed'; then
	if [ "$(id -u)" -ne 0 ]; then
		log "need root to install etcd-server"
		exit 1
	fi
	log "apt-get install etcd-server"
	if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q etcd-server >/dev/null; then
		apt-get update -q >/dev/null
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q etcd-server >/dev/null
	fi
	# The package starts a system etcd on 2379; the tests run their own on
	# other ports, in private directories.
	if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
		systemctl disable --now etcd >/dev/null 2>&1 || true
	fi
else
	log "etcd-server: installed"
fi

# --- CNI plugins -------------------------------------------------------------
if ! dpkg-query -W -f='${Status}' containernetworking-plugins 2>/dev/null | grep -q 'install ok installed'; then
	if [ "$(id -u)" -ne 0 ]; then
		log "need root to install containernetworking-plugins"
		exit 1
	fi
	log "apt-get install containernetworking-plugins"
	if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q containernetworking-plugins >/dev/null; then
		apt-get update -q >/dev/null
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q containernetworking-plugins >/dev/null
	fi
else
	log "containernetworking-plugins: installed"
fi

# --- the Kubernetes commands ---------------------------------------------------
have() {
	for c in $CMDS; do
		[ -x "$BIN/$c" ] || return 1
		"$BIN/$c" --version 2>/dev/null | grep -q "Kubernetes $K8S_VERSION\$" || return 1
	done
}
if have; then
	log "kubernetes $K8S_VERSION: $BIN"
	exit 0
fi

staging=v0.${K8S_VERSION#v1.}
dir=$(go mod download -json "k8s.io/kubernetes@$K8S_VERSION" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
if [ -z "$dir" ] || [ ! -f "$dir/go.mod" ]; then
	log "go mod download k8s.io/kubernetes@$K8S_VERSION gave no module directory"
	exit 1
fi
work=$CACHE/.src-$K8S_VERSION
rm -rf "$work"
mkdir -p "$CACHE"
cp -r "$dir" "$work"
chmod -R u+w "$work"
rm -f "$work/go.work" "$work/go.work.sum"
# k8s.io/X => ./staging/src/k8s.io/X   becomes   k8s.io/X => k8s.io/X v0.M.P
sed -i "s#^\([[:space:]]*\)\(k8s.io/[A-Za-z0-9._/-]*\) => ./staging/src/k8s.io/[A-Za-z0-9._/-]*\$#\1\2 => \2 $staging#" "$work/go.mod"
if grep -q '=> ./staging' "$work/go.mod"; then
	log "go.mod of k8s.io/kubernetes still replaces modules with ./staging: the rewrite did not match"
	exit 1
fi
major=${K8S_VERSION#v}
major=${major%%.*}
minor=${K8S_VERSION#v*.}
minor=${minor%%.*}
ldflags="-s -w"
for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
	ldflags="$ldflags -X $p.gitVersion=$K8S_VERSION -X $p.gitMajor=$major -X $p.gitMinor=$minor -X $p.gitTreeState=clean"
done
tmp=$CACHE/.bin-$K8S_VERSION
rm -rf "$tmp"
mkdir -p "$tmp"
for c in $CMDS; do
	log "go build ./cmd/$c ($K8S_VERSION)"
	(cd "$work" && GOWORK=off GOFLAGS=-mod=mod CGO_ENABLED=0 go build -trimpath -ldflags "$ldflags" -o "$tmp/$c" "./cmd/$c")
done
rm -rf "$BIN"
mkdir -p "$(dirname "$BIN")"
mv "$tmp" "$BIN"
rm -rf "$work"
have || { log "the built commands do not report Kubernetes $K8S_VERSION"; exit 1; }
log "kubernetes $K8S_VERSION: $BIN"
