#!/usr/bin/env bash
# Builds the pinned real container runtime (runc, containerd 2.x with ctr and the
# runc v2 shim, and the CNI plugins bridge, host-local and loopback) from the Go
# module proxy into a versioned cache directory, and prints that directory's bin
# path. A warm cache (all binaries present with the stamp file) skips the build.
#
# runc is built with cgo and the seccomp build tag when libseccomp's headers are
# there (Debian: libseccomp-dev, installed here when run as root with apt-get);
# without them it is built without seccomp support, and the cache dir says so.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
pin() { grep -E "^(require)?[[:space:]]*$1 v" "$2" | sed -n 1p | grep -oE ' v[^ ]+' | sed -n 1p | tr -d ' '; }
containerd_version=$(pin 'github\.com/containerd/containerd/v2' "$here/go.mod")
cni_version=$(pin 'github\.com/containernetworking/plugins' "$here/go.mod")
runc_version=$(pin 'github\.com/opencontainers/runc' "$here/runc/go.mod")
[[ -n "$containerd_version" && -n "$cni_version" && -n "$runc_version" ]] || {
  echo "build.sh: cannot read the pinned versions" >&2
  exit 1
}

if ! pkg-config --exists libseccomp 2>/dev/null && [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
  echo "build.sh: installing libseccomp-dev for runc's seccomp support" >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libseccomp-dev >&2 ||
    echo "build.sh: libseccomp-dev not installed; building runc without seccomp" >&2
fi
runc_tags="urfave_cli_no_docs"
seccomp="noseccomp"
if pkg-config --exists libseccomp 2>/dev/null; then
  runc_tags="seccomp $runc_tags"
  seccomp="seccomp$(pkg-config --modversion libseccomp)"
fi

cache_root=${MIGDRA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/migdra}
# The key covers every go.mod/go.sum line and the Go version, so any pin change rebuilds.
key=$( (cat "$here/go.mod" "$here/go.sum" "$here/runc/go.mod" "$here/runc/go.sum"; go version) | sha256sum | cut -c1-12)
out="$cache_root/runtime/containerd-$containerd_version-runc-$runc_version-$seccomp-cni-$cni_version-$key"
bins=(containerd ctr containerd-shim-runc-v2 runc bridge host-local loopback)

if [[ -f "$out/.complete" ]]; then
  echo "$out/bin"
  exit 0
fi

mkdir -p "$out/bin"
export GOFLAGS=-mod=mod
timed() {
  local what=$1 t0
  shift
  t0=$(date +%s)
  "$@" >&2
  echo "build.sh: built $what in $(($(date +%s) - t0))s" >&2
}

# runc: cgo (libseccomp, and nsenter's C part); the version comes from its embedded VERSION file.
timed "runc $runc_version" env CGO_ENABLED=1 go -C "$here/runc" build -trimpath -buildmode=pie \
  -tags "$runc_tags" -ldflags "-s -w -X main.gitCommit=$runc_version" \
  -o "$out/bin/runc" github.com/opencontainers/runc

# containerd, ctr and the shim: static, without cgo (so without the btrfs snapshotter).
pkg=github.com/containerd/containerd/v2
timed "containerd $containerd_version (containerd, ctr, containerd-shim-runc-v2)" \
  env CGO_ENABLED=0 go -C "$here" build -trimpath \
  -ldflags "-s -w -X $pkg/version.Version=$containerd_version -X $pkg/version.Revision=$containerd_version -X $pkg/version.Package=$pkg" \
  -o "$out/bin/" $pkg/cmd/containerd $pkg/cmd/ctr $pkg/cmd/containerd-shim-runc-v2

cni=github.com/containernetworking/plugins
timed "CNI plugins $cni_version (bridge, host-local, loopback)" \
  env CGO_ENABLED=0 go -C "$here" build -trimpath \
  -ldflags "-s -w -X $cni/pkg/utils/buildversion.BuildVersion=$cni_version" \
  -o "$out/bin/" $cni/plugins/main/bridge $cni/plugins/ipam/host-local $cni/plugins/main/loopback

for b in "${bins[@]}"; do
  [[ -x "$out/bin/$b" ]] || { echo "build.sh: $b missing after build" >&2; exit 1; }
done
touch "$out/.complete"
echo "$out/bin"
