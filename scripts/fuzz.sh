#!/usr/bin/env bash
# fuzz.sh [FUZZTIME]: runs every Fuzz function of the repository for
# FUZZTIME (default 5s) each, beyond its seed corpus (which the unit tests
# run). One instrumented test binary per package, run in the package's
# folder; the corpus is kept where `go test -fuzz` keeps it
# (GOCACHE/fuzz/<package>). A failing input is written to the package's
# testdata/fuzz/<Name>/: fix the parser and commit the input there as a
# seed.
#
# Go 1.26's fuzzing coordinator can fail a run with a bare "context
# deadline exceeded" when the FUZZTIME deadline races a busy worker
# (golang/go#75804, fixed in Go 1.27), with no failing input. Such a run is
# tried once more; a run that wrote a failing input, or failed any other
# way, fails at once.
set -euo pipefail
cd "$(dirname "$0")/.."
fuzztime=${1:-5s}
go=${GO:-go}
bins=$(mktemp -d)
trap 'rm -rf "$bins"' EXIT
cache=$($go env GOCACHE)/fuzz

# run DIR BIN NAME PKG: one fuzzer; 0 passed, 1 failed, 2 the coordinator's
# deadline race (no failing input).
run() {
  local dir=$1 bin=$2 name=$3 pkg=$4 out=$bins/out
  local before
  before=$(ls "$dir/testdata/fuzz/$name" 2>/dev/null | wc -l)
  if (cd "$dir" && "$bin" -test.run='^$' -test.fuzz="^$name\$" -test.fuzztime="$fuzztime" \
      -test.fuzzcachedir="$cache/$pkg") >"$out" 2>&1; then
    cat "$out"
    return 0
  fi
  cat "$out"
  local after
  after=$(ls "$dir/testdata/fuzz/$name" 2>/dev/null | wc -l)
  if [ "$after" = "$before" ] && ! grep -q 'Failing input written' "$out" &&
     grep -qx '[[:space:]]*context deadline exceeded' "$out" &&
     [ "$(grep -c -e '^--- FAIL' -e 'panic:' -e '_test.go:[0-9]*:' "$out")" = 1 ]; then
    return 2
  fi
  return 1
}

for dir in $(grep -rl --include='*_test.go' --exclude-dir=build --exclude-dir=.git '^func Fuzz' . | xargs -n1 dirname | sort -u); do
  pkg=$($go list "$dir")
  bin=$bins/$(echo "$pkg" | tr / _).test
  $go test -c -fuzz=. -o "$bin" "$dir"
  for name in $(sed -n 's/^func \(Fuzz[A-Za-z0-9_]*\)(.*/\1/p' "$dir"/*_test.go); do
    echo "fuzz $pkg $name $fuzztime"
    rc=0
    run "$dir" "$bin" "$name" "$pkg" || rc=$?
    if [ "$rc" = 2 ]; then
      echo "fuzz: $name: the fuzzing coordinator's deadline race (golang/go#75804), no failing input; once more"
      rc=0
      run "$dir" "$bin" "$name" "$pkg" || rc=$?
    fi
    if [ "$rc" != 0 ]; then
      echo "fuzz: $name failed; a failing input is in $dir/testdata/fuzz/$name/ when the fuzzer found one" >&2
      exit 1
    fi
  done
done
