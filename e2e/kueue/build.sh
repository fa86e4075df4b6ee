#!/usr/bin/env bash
# Builds the pinned Kueue controller manager from the Go module proxy into a
# versioned cache directory, copies the module's CRDs and webhook manifests next
# to it, and prints that directory (bin/kueue, crd/*.yaml, webhook/manifests.yaml).
# A warm cache (everything present with the stamp file) skips the build.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
version=$(grep -oE 'sigs\.k8s\.io/kueue v[0-9]+\.[0-9]+\.[0-9]+' "$here/go.mod" | head -1 | cut -d' ' -f2)
[[ -n "$version" ]] || { echo "build.sh: cannot read the pinned Kueue version" >&2; exit 1; }
cache_root=${MIGDRA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/migdra}
# The key covers every go.mod/go.sum line and the Go version, so any pin change rebuilds.
key=$( (cat "$here/go.mod" "$here/go.sum"; go version) | sha256sum | cut -c1-12)
out="$cache_root/kueue-$version-$key"

if [[ -f "$out/.complete" ]]; then
  echo "$out"
  exit 0
fi

export CGO_ENABLED=0 GOFLAGS=-mod=mod
mkdir -p "$out/bin" "$out/crd" "$out/webhook"
start=$(date +%s)
go -C "$here" build -trimpath \
  -ldflags "-s -w -X sigs.k8s.io/kueue/pkg/version.GitVersion=$version" \
  -o "$out/bin/kueue" sigs.k8s.io/kueue/cmd/kueue >&2
src=$(go -C "$here" list -m -f '{{.Dir}}' sigs.k8s.io/kueue)
cp "$src"/config/components/crd/bases/*.yaml "$out/crd/"
cp "$src/config/components/webhook/manifests.yaml" "$out/webhook/"
chmod -R u+w "$out"
[[ -x "$out/bin/kueue" ]] || { echo "build.sh: kueue missing after build" >&2; exit 1; }
echo "built Kueue $version in $(($(date +%s) - start))s" >&2
touch "$out/.complete"
echo "$out"
