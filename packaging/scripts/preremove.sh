#!/bin/sh
# mgpu package: before removal (deb prerm, rpm %preun).
#   deb: remove | upgrade <new-version> | deconfigure | failed-upgrade
#   rpm: 0 (erase) | 1 (upgrade)
# On removal: stops and disables the units (the kubelet device plugin
# included) and removes the generated CDI spec. On upgrade: nothing; the new
# package's postinst restarts the enforcers, which restore their instances,
# and a running device plugin. /etc/mgpu/config.toml and
# /var/lib/mgpu stay (a deb purge removes them).
set -e

case "$1" in
remove | 0) ;;
*) exit 0 ;;
esac

# dpkg keeps the configuration of a removed package and hands its version
# to the next install's postinst as if it were an upgrade: this marker tells
# that postinst to enable the units again (they are disabled below). A purge
# removes it with /var/lib/mgpu.
if [ "$1" = remove ]; then
	mkdir -p /var/lib/mgpu
	: >/var/lib/mgpu/.package-removed
fi

if [ -d /run/systemd/system ]; then
	# Stopping mgpu-enforcers.service stops every mgpu-enforcer@N (PartOf=);
	# the explicit stop covers enforcers started on their own. The device
	# plugin removes its socket from the kubelet's directory as it stops.
	systemctl disable --now mgpu-metrics.service mgpu-device-plugin.service mgpu-cdi-refresh.path mgpu-cdi-refresh.service mgpu-enforcers.service || :
	systemctl stop 'mgpu-enforcer@*.service' || :
	systemctl disable mgpu-enforcer@.service || :
else
	# Offline: only the symlinks of enabled units go.
	if command -v systemctl >/dev/null 2>&1; then
		systemctl disable mgpu-metrics.service mgpu-device-plugin.service mgpu-cdi-refresh.path mgpu-cdi-refresh.service mgpu-enforcers.service mgpu-enforcer@.service || :
	fi
	echo "mgpu: systemd is not running here; stop any mgpu-enforcer or mgpu-device-plugin you started yourself."
fi

# The spec `mgpu-cli cdi generate` wrote: <cdi_spec_dir>/<vendor>-<class>.{yaml,json}
# from the node configuration (plain `key = "value"` lines; defaults otherwise).
conf=/etc/mgpu/config.toml
value() {
	[ -r "$conf" ] || return 0
	sed -n "s/^[[:space:]]*$1[[:space:]]*=[[:space:]]*\"\([^\"]*\)\".*/\1/p" "$conf" | head -n 1
}
dir=$(value cdi_spec_dir)
kind=$(value cdi_kind)
dir=${dir:-/var/run/cdi}
kind=${kind:-mgpu.io/gpu}
vendor=${kind%%/*}
class=${kind#*/}
for f in "$dir/$vendor-$class.yaml" "$dir/$vendor-$class.json"; do
	if [ -e "$f" ]; then
		rm -f "$f"
		echo "mgpu: removed the CDI spec $f"
	fi
done
exit 0
