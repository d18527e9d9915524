#!/bin/sh
# stage.sh BUILD STAGE: checks that `make build` produced everything the
# packages ship and gathers it into STAGE ($(BUILD)/pkg), the directory
# nfpm runs in (packaging/nfpm.yaml names files relative to it): the build's
# binaries and shim, the repository's units, scripts, config and docs, and
# the generated files (the shim's preload file, the engine examples, the
# Debian copyright file). Run by `make package` from the repository root.
set -eu

build=${1:?usage: stage.sh BUILD STAGE}
stage=${2:?usage: stage.sh BUILD STAGE}

missing=
for f in bin/mgpu-cli bin/kubectl-inspect-mgpu bin/mgpu-device-plugin bin/mgpu-enforcer bin/mgpu-hook lib/libmgpu-shim.so; do
	[ -f "$build/$f" ] || missing="$missing $build/$f"
done
if [ -n "$missing" ]; then
	echo "make package: missing build output:$missing" >&2
	echo "make package: every packaged binary must build first (cmd/mgpu-cli, cmd/kubectl-inspect-mgpu, cmd/mgpu-device-plugin, cmd/mgpu-enforcer, cmd/mgpu-hook, enforcer/shim); see make build" >&2
	exit 1
fi

rm -rf "$stage"
mkdir -p "$stage/bin" "$stage/lib" "$stage/examples" "$stage/doc/docs"
for f in mgpu-cli kubectl-inspect-mgpu mgpu-device-plugin mgpu-enforcer mgpu-hook; do
	cp "$build/bin/$f" "$stage/bin/"
done
cp "$build/lib/libmgpu-shim.so" "$stage/lib/"
cp -R packaging/systemd packaging/scripts packaging/config "$stage/"
cp README.md LICENSE "$stage/doc/"
cp docs/*.md "$stage/doc/docs/"

# The CDI spec bind-mounts this file at /etc/ld.so.preload in containers
# (cdi.PreloadPath/PreloadContent): the shim's absolute path and a newline.
printf '%s\n' /usr/lib/mgpu/libmgpu-shim.so >"$stage/ld.so.preload"

# Engine examples, produced by the packaged mgpu-cli itself against empty
# engine configurations in a scratch directory, so they match what
# `mgpu-cli runtime configure` writes on a node.
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cli="$build/bin/mgpu-cli --config packaging/config/config.toml"
$cli runtime configure --runtime containerd \
	--config-file "$tmp/containerd/config.toml" --drop-in "$tmp/containerd/conf.d/mgpu.toml" >/dev/null
cp "$tmp/containerd/conf.d/mgpu.toml" "$stage/examples/containerd-mgpu.toml"
$cli runtime configure --runtime docker --config-file "$tmp/docker/daemon.json" >/dev/null
cp "$tmp/docker/daemon.json" "$stage/examples/docker-daemon.json"
# The Grafana dashboard of `mgpu-cli metrics serve` (docs/metrics.md).
cp packaging/grafana/mgpu-dashboard.json "$stage/examples/grafana-dashboard.json"

cat >"$stage/copyright" <<'COPYRIGHT'
Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: mgpu
Source: https://github.com/mgpu-dev/mgpu

Files: *
Copyright: The mgpu authors
License: Apache-2.0
 On Debian systems, the full text of the Apache License, Version 2.0 is in
 /usr/share/common-licenses/Apache-2.0 and in /usr/share/doc/mgpu/LICENSE.
COPYRIGHT
