#!/usr/bin/env bash
# The chart's CRDs are generated from the Rust types (migdra-api) by `migdra-controller
# print-crds`. `crds.sh write` regenerates charts/migdra/crds/; `crds.sh check` fails when the
# committed files differ from what the code generates.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-check}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
cargo run --quiet -p migdra-controller -- print-crds > "$out/all.yaml"
# Split the multi-document output into one file per CRD, named after its plural.
awk -v dir="$out" '
  /^---$/ { n++; next }
  { docs[n] = docs[n] $0 "\n" }
  /^  name: [a-z]+\.gpu\.migdra\.dev$/ && !(n in names) { split($2, parts, "."); names[n] = parts[1] }
  END { for (i in docs) { f = dir "/" names[i] ".yaml"; printf "---\n%s", docs[i] > f } }
' "$out/all.yaml"
for crd in gpunodes migpolicies; do
  [[ -s "$out/$crd.yaml" ]] || { echo "crds.sh: print-crds did not produce $crd" >&2; exit 1; }
done
case "$mode" in
  write)
    cp "$out/gpunodes.yaml" "$out/migpolicies.yaml" charts/migdra/crds/
    echo "wrote charts/migdra/crds/{gpunodes,migpolicies}.yaml"
    ;;
  check)
    status=0
    for crd in gpunodes migpolicies; do
      if ! diff -u "charts/migdra/crds/$crd.yaml" "$out/$crd.yaml"; then
        echo "charts/migdra/crds/$crd.yaml is out of date: run 'make crds'" >&2
        status=1
      fi
    done
    exit $status
    ;;
  *) echo "usage: $0 write|check" >&2; exit 2 ;;
esac
