#!/bin/sh
# mgpu package: after install or upgrade (deb postinst, rpm %post).
#   deb: configure <old-version, empty on first install> | abort-upgrade | ...
#   rpm: 1 (install) | 2 (upgrade)
# Regenerates the CDI spec and (re)starts the enforcers of the GPUs present.
# An upgrade restarts running enforcers in place: each restores its instances
# from /var/lib/mgpu/gpuX and the regions under /run/mgpu stay, so running
# containers keep their quotas. Never touches an engine's configuration
# (that is `mgpu-cli runtime configure`). Without a running systemd
# (chroot, container, image build) it only enables the units for the next
# boot and says so. The kubelet device plugin is never started here: the
# preset leaves it disabled, and one that an administrator enabled and that
# runs is restarted with the new binary on upgrade.
set -e

units="mgpu-enforcers.service mgpu-cdi-refresh.service mgpu-cdi-refresh.path"
plugin=mgpu-device-plugin.service
exporter=mgpu-metrics.service

first=
case "$1" in
configure) [ -n "${2:-}" ] || first=1 ;;
1) first=1 ;;
2) ;;
abort-upgrade | abort-remove | abort-deconfigure) ;;
*) exit 0 ;;
esac
# Reinstalled after a deb remove (see preremove.sh): a first install again.
if [ -e /var/lib/mgpu/.package-removed ]; then
	first=1
	rm -f /var/lib/mgpu/.package-removed
fi

if [ -n "$first" ] && command -v systemctl >/dev/null 2>&1; then
	# Enable what the preset file (/usr/lib/systemd/system-preset/90-mgpu.preset)
	# enables, unless the administrator's presets say otherwise. This works
	# without a running systemd too (image builds): it only makes symlinks.
	# The preset disables the device plugin (not every GPU node is a
	# Kubernetes node) unless an administrator's preset enables it.
	# shellcheck disable=SC2086 # a list of unit names
	systemctl preset $units "$plugin" "$exporter" || :
fi

if [ ! -d /run/systemd/system ]; then
	echo "mgpu: systemd is not running here; not starting enforcers or generating the CDI spec now."
	echo "mgpu: on the booted node the units do it ($units);"
	echo "mgpu: without systemd run 'mgpu-cli cdi generate' and 'mgpu-enforcer --device N' yourself."
	exit 0
fi

systemctl daemon-reload || :

# The spec first: containers started from now on need it. A node without a
# GPU or driver yet gets it at boot (mgpu-cdi-refresh.path also re-runs it
# when the driver's modules change).
if ! systemctl restart mgpu-cdi-refresh.service; then
	echo "mgpu: warning: the CDI spec was not generated (no GPU or driver yet?): journalctl -u mgpu-cdi-refresh.service" >&2
fi
if systemctl is-enabled --quiet mgpu-cdi-refresh.path; then
	systemctl start mgpu-cdi-refresh.path || :
fi

# Restart, never stop and purge: a restarted enforcer restores its instances.
if systemctl is-enabled --quiet mgpu-enforcers.service; then
	# Restarts the running mgpu-enforcer@N (PartOf=) and starts one per GPU.
	if ! systemctl restart mgpu-enforcers.service; then
		echo "mgpu: warning: not every enforcer started (no GPU or driver yet?): journalctl -u mgpu-enforcers.service -u 'mgpu-enforcer@*'" >&2
	fi
else
	# Enforcers enabled one by one (systemctl enable mgpu-enforcer@N).
	systemctl try-restart 'mgpu-enforcer@*.service' || :
fi

# The device plugin, after the enforcers it asks about GPU health: only if
# it runs (an upgrade); a stopped or disabled one stays so.
systemctl try-restart "$plugin" || :
# The exporter likewise: restarted with the new binary only if it runs.
systemctl try-restart "$exporter" || :
exit 0
