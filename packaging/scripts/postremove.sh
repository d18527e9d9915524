#!/bin/sh
# mgpu package: after removal (deb postrm, rpm %postun).
#   deb: remove | purge | upgrade | failed-upgrade | abort-install | ...
#   rpm: 0 (erase) | 1 (upgrade)
# purge (deb only) also removes the instance tables (/var/lib/mgpu) and the
# run directory (/run/mgpu); dpkg itself removes /etc/mgpu/config.toml.
set -e

case "$1" in
remove | purge | 0 | 1 | upgrade)
	if [ -d /run/systemd/system ]; then
		systemctl daemon-reload || :
	fi
	;;
esac

if [ "$1" = purge ]; then
	rm -rf /var/lib/mgpu /run/mgpu
	rmdir /etc/mgpu 2>/dev/null || :
fi
exit 0
