#!/usr/bin/env bash
# Builds promtool from the Prometheus Go module pinned in go.mod (next to this script) into a
# versioned cache directory and prints the binary's path. A warm cache (the binary present with
# the stamp file) skips the build. The chart tests run it (charts/tests/run.sh) to check the
# chart's rules and the dashboard's queries and to unit-test them with `promtool test rules`.
#
# Needs go (>= the go line of go.mod) and, the first time, the Go module proxy.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
# Prometheus 3.x is published to the Go module proxy as v0.3MM.P (3.MM.P).
mod_version=$(grep -oE 'github\.com/prometheus/prometheus v[0-9]+\.[0-9]+\.[0-9]+' "$here/go.mod" | head -1 | cut -d' ' -f2)
[[ -n "$mod_version" ]] || { echo "promtool/build.sh: cannot read the pinned Prometheus version" >&2; exit 1; }
minor=$(echo "$mod_version" | cut -d. -f2)
patch=$(echo "$mod_version" | cut -d. -f3)
if [[ "$minor" =~ ^[1-9][0-9]{2}$ ]]; then
  prom_version="$((minor / 100)).$((10#${minor:1})).$patch"
else
  prom_version="$mod_version"
fi
cache_root=${MIGDRA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/migdra}
# The key covers every go.mod/go.sum line, so any pin change rebuilds.
key=$(cat "$here/go.mod" "$here/go.sum" | sha256sum | cut -c1-12)
out="$cache_root/promtool/prometheus-$mod_version-$key"
bin="$out/bin/promtool"

if [[ -f "$out/.complete" && -x "$bin" ]]; then
  echo "$bin"
  exit 0
fi

command -v go >/dev/null || { echo "promtool/build.sh: go is required to build promtool" >&2; exit 1; }
rm -rf "$out"
mkdir -p "$out/bin"
# readonly: the build uses exactly the committed go.sum (a missing or changed sum fails).
export CGO_ENABLED=0 GOFLAGS=-mod=readonly
ldflags="-s -w"
ldflags+=" -X github.com/prometheus/common/version.Version=$prom_version"
ldflags+=" -X github.com/prometheus/common/version.Branch=$mod_version"
ldflags+=" -X github.com/prometheus/common/version.BuildUser=migdra"

start=$(date +%s)
echo "==> building promtool $prom_version ($mod_version) into $out" >&2
(
  cd "$here"
  go build -trimpath -ldflags "$ldflags" -o "$bin" github.com/prometheus/prometheus/cmd/promtool
) >&2
[[ -x "$bin" ]] || { echo "promtool/build.sh: promtool missing after the build" >&2; exit 1; }
echo "built promtool in $(( $(date +%s) - start ))s" >&2
touch "$out/.complete"
echo "$bin"
