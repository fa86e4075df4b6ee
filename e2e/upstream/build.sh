#!/usr/bin/env bash
# Builds the pinned upstream Kubernetes components and etcd from the Go module
# proxy into a versioned cache directory, and prints that directory's bin path.
# A warm cache (all binaries present with the stamp file) skips the build.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
# MIGDRA_K8S_MINOR selects an older supported minor, pinned in its own module under v<minor>/;
# unset (or the default minor) builds the module in this directory.
default_minor=$(grep -oE 'k8s\.io/kubernetes v1\.[0-9]+' "$here/go.mod" | head -1 | cut -d' ' -f2 | cut -c2-)
k8s_dir=$here
if [[ -n "${MIGDRA_K8S_MINOR:-}" && "$MIGDRA_K8S_MINOR" != "$default_minor" ]]; then
  k8s_dir="$here/v$MIGDRA_K8S_MINOR"
  [[ -f "$k8s_dir/go.mod" ]] || {
    echo "build.sh: MIGDRA_K8S_MINOR=$MIGDRA_K8S_MINOR is not pinned (no $k8s_dir/go.mod)" >&2
    exit 1
  }
fi
k8s_version=$(grep -oE 'k8s\.io/kubernetes v[0-9]+\.[0-9]+\.[0-9]+' "$k8s_dir/go.mod" | head -1 | cut -d' ' -f2)
etcd_version=$(grep -oE 'go\.etcd\.io/etcd/server/v3 v[0-9]+\.[0-9]+\.[0-9]+' "$here/etcd/go.mod" | head -1 | cut -d' ' -f2)
[[ -n "$k8s_version" && -n "$etcd_version" ]] || { echo "build.sh: cannot read the pinned versions" >&2; exit 1; }
cache_root=${MIGDRA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/migdra}
# The key covers the pinned versions and every go.mod/go.sum line, so any pin change rebuilds.
key=$(cat "$k8s_dir/go.mod" "$k8s_dir/go.sum" "$here/etcd/go.mod" "$here/etcd/go.sum" | sha256sum | cut -c1-12)
out="$cache_root/upstream/k8s-$k8s_version-etcd-$etcd_version-$key"
bins=(kube-apiserver kube-controller-manager kube-scheduler kubelet kubectl etcd)

if [[ -f "$out/.complete" ]]; then
  echo "$out/bin"
  exit 0
fi

mkdir -p "$out/bin"
export CGO_ENABLED=0 GOFLAGS=-mod=mod
minor=$(echo "$k8s_version" | cut -d. -f2)
build_date=$(date -u +%Y-%m-%dT%H:%M:%SZ)
ldflags=""
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags+=" -X $pkg.gitVersion=$k8s_version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
  ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=$build_date"
done

start=$(date +%s)
(
  cd "$k8s_dir"
  go build -trimpath -ldflags "-s -w $ldflags" -o "$out/bin/" \
    k8s.io/kubernetes/cmd/kube-apiserver \
    k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kube-scheduler \
    k8s.io/kubernetes/cmd/kubelet \
    k8s.io/kubernetes/cmd/kubectl
) >&2
(
  cd "$here/etcd"
  go build -trimpath -ldflags "-s -w" -o "$out/bin/etcd" go.etcd.io/etcd/server/v3
) >&2
for b in "${bins[@]}"; do
  [[ -x "$out/bin/$b" ]] || { echo "build.sh: $b missing after build" >&2; exit 1; }
done
echo "built upstream binaries in $(( $(date +%s) - start ))s" >&2
touch "$out/.complete"
echo "$out/bin"
