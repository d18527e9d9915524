#!/bin/sh
# install.sh: installs mgpu on a GPU node image (Packer, bootc, cloud-init,
# or by hand on a running node). See README.md beside this file.
#
#   install.sh [--runtime containerd|docker|podman]... [--package FILE] [--no-verify]
#
# 1. installs the package (FILE, or mgpu from the configured apt/dnf repo);
# 2. makes each engine read CDI specs (`mgpu-cli runtime configure`);
# 3. enables the units (works in a chroot: systemd need not run);
# 4. when systemd runs and a GPU is present: generates the CDI spec, starts
#    the enforcers and checks them with `mgpu-cli device info -a`.
# Idempotent: running it again changes nothing that is already in place.
set -eu

runtimes=
pkg=
verify=1
while [ $# -gt 0 ]; do
	case $1 in
	--runtime) runtimes="$runtimes ${2:?--runtime needs containerd, docker or podman}"; shift 2 ;;
	--runtime=*) runtimes="$runtimes ${1#--runtime=}"; shift ;;
	--package) pkg=${2:?--package needs a .deb or .rpm}; shift 2 ;;
	--package=*) pkg=${1#--package=}; shift ;;
	--no-verify) verify=; shift ;;
	-h | --help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
	*) echo "install.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
	esac
done
[ "$(id -u)" = 0 ] || { echo "install.sh: run as root" >&2; exit 1; }

say() { echo "mgpu install: $*"; }

# 1. The package. Never prompt: an image may carry its own
# /etc/mgpu/config.toml already, which is kept (apt: --force-confold;
# rpm's %config(noreplace) keeps it and writes the packaged one as .rpmnew).
apt_install() {
	DEBIAN_FRONTEND=noninteractive apt-get install -y \
		-o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold "$@"
}
case $pkg in
*.deb) say "installing $pkg"; apt_install "$(realpath "$pkg")" ;;
*.rpm) say "installing $pkg"; dnf install -y "$(realpath "$pkg")" ;;
'')
	if command -v apt-get >/dev/null 2>&1; then
		apt_install mgpu
	elif command -v dnf >/dev/null 2>&1; then
		dnf install -y mgpu
	else
		echo "install.sh: no apt-get or dnf; pass --package FILE" >&2
		exit 1
	fi
	;;
*) echo "install.sh: --package $pkg is neither a .deb nor an .rpm" >&2; exit 2 ;;
esac

# 2. The engines. Only ever through mgpu-cli, which keeps every other setting.
for r in $runtimes; do
	say "configuring $r for CDI"
	mgpu-cli runtime configure --runtime "$r"
done

# 3. The units (the package's first install enables them too; an image may
# have disabled them, so say it again).
systemctl enable mgpu-cdi-refresh.service mgpu-cdi-refresh.path mgpu-enforcers.service

if [ ! -d /run/systemd/system ]; then
	say "systemd is not running (image build): the units start on the node's first boot"
	exit 0
fi

# 4. A running node: apply now.
systemctl daemon-reload
for r in $runtimes; do
	case $r in
	containerd | docker) systemctl try-restart "$r.service" ;;
	esac
done
if ! mgpu-cli device info -a >/dev/null 2>&1; then
	say "no GPU visible yet (driver not loaded?): the units start when it is; check later with mgpu-cli device info -a"
	exit 0
fi
systemctl restart mgpu-cdi-refresh.service
systemctl restart mgpu-enforcers.service
if [ -n "$verify" ]; then
	mgpu-cli device info -a
	mgpu-cli cdi list >/dev/null
	say "done: containers can ask for --device mgpu.io/gpu=N"
fi
