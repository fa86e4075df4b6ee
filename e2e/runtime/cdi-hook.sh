#!/usr/bin/env bash
# Builds NVIDIA's nvidia-cdi-hook with kubelet-plugin/cdi-hook/build.sh (what the Dockerfile's
# cdi-hook stage runs) into ${MIGDRA_CACHE_DIR:-~/.cache/migdra}/cdi-hook/<version>-<key>, and
# prints the binary's path. A warm cache (the .complete stamp) returns at once; the key covers
# go.mod, go.sum, build.sh, the Go version and the glibc the binary links.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
src=$(cd "$here/../../kubelet-plugin/cdi-hook" && pwd)
version=$(grep -oE '^require github.com/NVIDIA/nvidia-container-toolkit v[^ ]+' "$src/go.mod" | cut -d' ' -f3)
[[ -n $version ]] || { echo "cdi-hook.sh: cannot read the pinned version from $src/go.mod" >&2; exit 1; }
cache_root=${MIGDRA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/migdra}
key=$( (cat "$src/go.mod" "$src/go.sum" "$src/build.sh"; go version; ldd --version | sed -n 1p) | sha256sum | cut -c1-12)
out=$cache_root/cdi-hook/nvidia-container-toolkit-$version-$key
if [[ -f $out/.complete ]]; then
  echo "$out/nvidia-cdi-hook"
  exit 0
fi
rm -rf "$out"
t0=$(date +%s)
bash "$src/build.sh" "$out" >&2
touch "$out/.complete"
echo "cdi-hook.sh: built nvidia-cdi-hook $version in $(($(date +%s) - t0))s" >&2
echo "$out/nvidia-cdi-hook"
