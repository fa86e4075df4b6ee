#!/usr/bin/env bash
# build.sh OUT_DIR: builds NVIDIA's nvidia-cdi-hook at the version go.mod pins, from the Go
# module proxy, into OUT_DIR/nvidia-cdi-hook. The Dockerfile's cdi-hook stage runs it, and so
# does e2e/runtime/cdi-hook.sh (which caches the result), so both builds are the same.
#
# cgo is on: the toolkit links NVIDIA's go-nvml, whose bindings are cgo (it dlopens
# libnvidia-ml only when a command needs it; the hook commands the kubelet plugin's CDI specs
# name do not). The binary links the glibc of the machine that builds it.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
out=${1:?usage: build.sh OUT_DIR}
module=github.com/NVIDIA/nvidia-container-toolkit
version=$(grep -oE "^require $module v[^ ]+" "$here/go.mod" | cut -d' ' -f3)
[[ -n $version ]] || { echo "build.sh: cannot read the pinned $module version from go.mod" >&2; exit 1; }
mkdir -p "$out"
GOFLAGS="-mod=mod -buildvcs=false" CGO_ENABLED=1 CGO_CFLAGS="${CGO_CFLAGS:-} -Wno-deprecated-declarations" \
  go -C "$here" build -trimpath -ldflags "-s -w -X $module/internal/info.version=$version" \
  -o "$out/nvidia-cdi-hook" "$module/cmd/nvidia-cdi-hook"
"$out/nvidia-cdi-hook" --version >/dev/null
