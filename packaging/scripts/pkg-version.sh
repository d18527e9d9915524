#!/bin/sh
# pkg-version.sh [VERSION]: prints a version that dpkg and rpm both accept and
# order correctly, for `make package`.
#
#   v1.2.3 or 1.2.3             -> 1.2.3
#   v1.2.3-4-gabc1234           -> 1.2.3+git4.abc1234  (4 commits after the tag: newer than 1.2.3)
#   v1.2.3-rc1                  -> 1.2.3~rc1           (a pre-release: older than 1.2.3)
#   abc1234 (no tag reachable)  -> 0.0.0~gitN.abc1234  (N commits: older than any release, newer with N)
#   -dirty (uncommitted changes) adds .dirty
#
# With no argument it reads `git describe --tags --always --dirty`.
set -eu

v=${1:-}
if [ -z "$v" ]; then
	v=$(git describe --tags --always --dirty 2>/dev/null) || {
		echo "pkg-version.sh: not a git checkout and no VERSION given; run make package VERSION=X.Y.Z" >&2
		exit 1
	}
fi

dirty=
case $v in
*-dirty) dirty=.dirty v=${v%-dirty} ;;
esac
v=${v#v}

if printf '%s\n' "$v" | grep -Eq '^[0-9a-f]{7,40}$' && printf '%s\n' "$v" | grep -q '[a-f]'; then
	# An abbreviated commit: no tag. Order snapshots by their commit count.
	n=$(git rev-list --count HEAD 2>/dev/null || echo 0)
	out="0.0.0~git$n.$v"
elif printf '%s\n' "$v" | grep -Eq '^[0-9][0-9.]*-[0-9]+-g[0-9a-f]+$'; then
	base=${v%%-*}
	rest=${v#*-}
	n=${rest%%-*}
	hash=${rest#*-g}
	out="$base+git$n.$hash"
elif printf '%s\n' "$v" | grep -Eq '^[0-9][0-9.]*-[0-9A-Za-z.]+-[0-9]+-g[0-9a-f]+$'; then
	# A pre-release tag with commits after it: v1.2.3-rc1-4-gabc.
	base=${v%%-*}
	rest=${v#*-}
	pre=${rest%%-*}
	rest=${rest#*-}
	n=${rest%%-*}
	hash=${rest#*-g}
	out="$base~$pre+git$n.$hash"
elif printf '%s\n' "$v" | grep -Eq '^[0-9][0-9.]*-[0-9A-Za-z.]+$'; then
	out="${v%%-*}~${v#*-}"
elif printf '%s\n' "$v" | grep -Eq '^[0-9][0-9A-Za-z.+~]*$'; then
	out=$v
else
	echo "pkg-version.sh: cannot make a package version of ${1:-$v} (want a tag like v1.2.3 or X.Y.Z)" >&2
	exit 1
fi
printf '%s%s\n' "$out" "$dirty"
