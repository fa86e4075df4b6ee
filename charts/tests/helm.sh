#!/usr/bin/env bash
# Prints the path of a helm binary built from the Go module proxy at a pinned version, building
# it on first use into ${MIGDRA_CACHE_DIR:-$HOME/.cache/migdra}/helm-<version>/helm.
# Used by the chart tests and by the end-to-end cluster, which installs the chart.
set -euo pipefail

HELM_VERSION="${MIGDRA_HELM_VERSION:-v3.22.0}"
# Kubernetes version helm reports by default (its capabilities when not talking to a cluster).
HELM_DEFAULT_KUBE_MINOR=37
cache="${MIGDRA_CACHE_DIR:-$HOME/.cache/migdra}"
mkdir -p "$cache"

helm_dir="$cache/helm-$HELM_VERSION"
helm="$helm_dir/helm"
if [[ ! -x "$helm" ]]; then
  echo "==> building helm $HELM_VERSION from the Go module proxy into $helm_dir" >&2
  command -v go >/dev/null || { echo "go is required to build helm" >&2; exit 1; }
  tmp_bin="$(mktemp -d "$cache/helm-build.XXXXXX")"
  trap 'rm -rf "$tmp_bin"' EXIT
  ldflags="-s -w"
  ldflags+=" -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
  ldflags+=" -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
  for pkg in pkg/chartutil pkg/lint/rules; do
    ldflags+=" -X helm.sh/helm/v3/$pkg.k8sVersionMajor=1"
    ldflags+=" -X helm.sh/helm/v3/$pkg.k8sVersionMinor=$HELM_DEFAULT_KUBE_MINOR"
  done
  GOTOOLCHAIN=local GOFLAGS=-mod=mod CGO_ENABLED=0 GOBIN="$tmp_bin" \
    go install -trimpath -ldflags "$ldflags" "helm.sh/helm/v3/cmd/helm@$HELM_VERSION" >&2
  mkdir -p "$helm_dir"
  mv "$tmp_bin/helm" "$helm"
fi
echo "$helm"
