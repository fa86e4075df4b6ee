#!/usr/bin/env bash
# Offline tests of the migdra Helm chart.
#
#   1. Builds helm from the Go module proxy (once; cached under
#      ${MIGDRA_CACHE_DIR:-$HOME/.cache/migdra}/helm-<version>/helm).
#   2. Builds promtool from the Go module pinned in promtool/go.mod (once; cached by
#      promtool/build.sh under ${MIGDRA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/migdra}/promtool/).
#      The tests check and unit-test the chart's alerts and the dashboard's queries with it.
#   3. Creates a Python venv with the test dependencies (once per requirements.txt content;
#      cached under ${MIGDRA_CACHE_DIR:-$HOME/.cache/migdra}/chart-tests-venv-<hash>/).
#   4. helm lint --strict and helm template with the default values and values-custom.yaml.
#   5. pytest on the rendered manifests (charts/tests/test_*.py).
#
# Needs: go (>= the go lines of helm's go.mod and of promtool/go.mod), python3 with venv, and
# access to the Go module proxy and PyPI the first time. Extra arguments are passed to pytest.
set -euo pipefail

# Kubernetes version we render for.
KUBE_VERSION="${MIGDRA_CHART_KUBE_VERSION:-1.35.0}"

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
chart="$repo/charts/migdra"
cache="${MIGDRA_CACHE_DIR:-$HOME/.cache/migdra}"
mkdir -p "$cache"

log() { printf '==> %s\n' "$*" >&2; }

# --- 1. helm -----------------------------------------------------------------------------
helm="$(bash "$here/helm.sh")"
log "helm: $("$helm" version --short) ($helm)"

# Keep helm away from the user's config, caches and any cluster.
helm_home="$(mktemp -d)"
trap 'rm -rf "$helm_home"' EXIT
export HELM_CONFIG_HOME="$helm_home/config" HELM_CACHE_HOME="$helm_home/cache" \
  HELM_DATA_HOME="$helm_home/data" KUBECONFIG=/dev/null

# --- 2. promtool ----------------------------------------------------------------------------
promtool="$(bash "$here/promtool/build.sh")"
log "promtool: $("$promtool" --version 2>&1 | head -1) ($promtool)"

# --- 3. Python venv ------------------------------------------------------------------------
req="$here/requirements.txt"
req_hash="$(sha256sum "$req" | cut -c1-12)"
venv="$cache/chart-tests-venv-$req_hash"
if [[ ! -x "$venv/bin/pytest" ]] || [[ ! -f "$venv/.complete" ]]; then
  log "creating the Python venv $venv"
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$req"
  touch "$venv/.complete"
fi

# --- 4. lint and render --------------------------------------------------------------------
out="$(mktemp -d)"
trap 'rm -rf "$helm_home" "$out"' EXIT
for name in default custom; do
  args=()
  [[ "$name" == custom ]] && args=(-f "$here/values-custom.yaml")
  log "helm lint --strict ($name values)"
  "$helm" lint --strict --kube-version "$KUBE_VERSION" "${args[@]}" "$chart"
  log "helm template ($name values)"
  "$helm" template migdra "$chart" --namespace migdra-system --kube-version "$KUBE_VERSION" \
    --include-crds "${args[@]}" >"$out/$name.yaml"
  log "rendered $(grep -c '^kind:' "$out/$name.yaml") objects"
done

# --- 5. pytest -----------------------------------------------------------------------------
log "pytest"
export MIGDRA_HELM="$helm" MIGDRA_PROMTOOL="$promtool" MIGDRA_CHART="$chart" MIGDRA_REPO="$repo" \
  MIGDRA_CHART_KUBE_VERSION="$KUBE_VERSION"
cd "$here"
"$venv/bin/python" -m pytest -p no:cacheprovider "$here" "$@"
