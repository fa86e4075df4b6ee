#!/usr/bin/env bash
# Builds migdra's images from the repository's Dockerfile without a Docker daemon, plus the
# e2e workload image, as OCI image layout tarballs (for `ctr -n k8s.io images import`), into
# ${MIGDRA_CACHE_DIR:-~/.cache/migdra}/migdra-images/<key>, and prints that directory. It holds
# images.txt, one "name<TAB>tarball" line per image:
#
#   ghcr.io/migdra/migdra-controller:0.1.0       \  the Dockerfile's runtime stages, under the
#   ghcr.io/migdra/migdra-kubelet-plugin:0.1.0    > names its header gives them
#   ghcr.io/migdra/kubectl-migdra:0.1.0          /
#   migdra.dev/e2e/gpu-probe:e2e                 the workload probe (gpu-probe/gpu-probe.c)
#
# How (see README.md, "migdra's images"): dockerfile_plan.py reads the Dockerfile and refuses
# any instruction this script does not reproduce. The rust builder stage's cargo command runs
# here as written; the golang stage's build.sh runs through cdi-hook.sh (cached). The
# debian:<release>-slim base is made with mmdebstrap (minbase, docs and locales left out) and
# cached, keyed on the release and the options; its package versions go into the images' key.
# Each image is two layers: that base, and the files the stage copies.
#
# MIGDRA_BIN_DIR: a directory with the release binaries already built; skips cargo.
# A warm cache returns at once: the key covers the build context (what docker build would
# send: git's files minus .dockerignore) or MIGDRA_BIN_DIR's binaries, the hook, the base's
# packages, the probe's source and gcc's version, and these scripts.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$here/lib.sh"
probe_image=migdra.dev/e2e/gpu-probe:e2e

for t in python3 gcc tar gzip sha256sum git; do
  command -v "$t" >/dev/null || { rt_log "needs $t"; exit 1; }
done
cd "$repo"
plan=$(python3 "$here/dockerfile_plan.py" Dockerfile)
cache_root=${MIGDRA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/migdra}
mkdir -p "$cache_root/debian-base" "$cache_root/migdra-images"

# debian_base RELEASE: prints the cache dir of the base, made if missing: rootfs/, its layer
# (layer.tar.gz, .diffid) and packages.txt (package versions).
debian_base() {
  local release=$1 key out mirror=http://deb.debian.org
  local opts=(--variant=minbase --format=directory
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*'
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright'
    --dpkgopt='path-exclude=/usr/share/locale/*')
  local sources=("deb $mirror/debian $release main" "deb $mirror/debian $release-updates main"
    "deb $mirror/debian-security $release-security main")
  if ! command -v mmdebstrap >/dev/null; then
    if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
      rt_log "installing mmdebstrap"
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mmdebstrap >&2
    else
      rt_log "needs mmdebstrap (Debian: apt-get install mmdebstrap)"
      return 1
    fi
  fi
  key=$( (echo "$release"; printf '%s\n' "${opts[@]}" "${sources[@]}"; mmdebstrap --version) | sha256sum | cut -c1-12)
  out=$cache_root/debian-base/$release-$key
  if [[ ! -f $out/.complete ]]; then
    rm -rf "$out"
    mkdir -p "$out"
    rt_log "making the Debian $release base with mmdebstrap (once; cached in $out)"
    mmdebstrap "${opts[@]}" "$release" "$out/rootfs" "${sources[@]}" >&2
    # The runtime mounts /dev; the image's is empty, like Debian's own images.
    find "$out/rootfs/dev" -mindepth 1 -delete
    dpkg-query --admindir="$out/rootfs/var/lib/dpkg" -W -f '${Package}\t${Version}\n' >"$out/packages.txt"
    rt_layer "$out/rootfs" "$out/layer.tar.gz" keep-owners
    touch "$out/.complete"
  fi
  echo "$out"
}

exec 9>"$cache_root/migdra-images/.lock"
flock 9

base=""
cargo_stage="" cargo_command="" cargo_bins=() hook="" hook_stage=""
while IFS=$'\t' read -r kind stage a b; do
  case $kind in
    base) base=$(debian_base "$a") ;;
    cargo)
      cargo_stage=$stage cargo_command=$a
      read -r -a cargo_bins <<<"${b//$'\t'/ }"
      ;;
    go)
      [[ $a == kubelet-plugin/cdi-hook && $b == nvidia-cdi-hook ]] ||
        { rt_log "Dockerfile stage $stage builds $a ($b): only kubelet-plugin/cdi-hook is known here"; exit 1; }
      hook_stage=$stage
      hook=$(bash "$here/cdi-hook.sh")
      ;;
  esac
done <<<"$plan"
[[ -n $base && -n $cargo_stage ]] || { rt_log "the Dockerfile plan has no base or no cargo builder"; exit 1; }

if [[ -n ${MIGDRA_BIN_DIR:-} ]]; then
  bin_dir=$(cd "$MIGDRA_BIN_DIR" && pwd)
  for b in "${cargo_bins[@]}"; do
    [[ -x $bin_dir/$b ]] || { rt_log "MIGDRA_BIN_DIR=$MIGDRA_BIN_DIR has no executable $b"; exit 1; }
  done
  binaries_key=$(cd "$bin_dir" && sha256sum "${cargo_bins[@]}")
else
  target=${CARGO_TARGET_DIR:-target}
  [[ $target == /* ]] || target=$repo/$target
  bin_dir=$target/release
  binaries_key=$(python3 "$here/dockerfile_plan.py" --context-digest)
fi
key=$( (echo "$plan"; echo "$binaries_key"; sha256sum "$hook"; cat "$base/packages.txt"
  cat "$here/gpu-probe/gpu-probe.c" "$here/lib.sh" "$here/dockerfile_plan.py" "$here/migdra-images.sh"; gcc --version | sed -n 1p) |
  sha256sum | cut -c1-12)
out=$cache_root/migdra-images/$key
if [[ -f $out/.complete ]]; then
  echo "$out"
  exit 0
fi

if [[ -z ${MIGDRA_BIN_DIR:-} ]]; then
  rt_log "building the release binaries: $cargo_command"
  t0=$(date +%s)
  read -r -a cargo_args <<<"$cargo_command"
  "${cargo_args[@]}" >&2
  rt_log "cargo build took $(($(date +%s) - t0))s"
fi

rm -rf "$out"
mkdir -p "$out"
work=$(mktemp -d "$out/.build.XXXXXX")
trap 'rm -rf "$work"' EXIT

# source STAGE PATH: the host file a COPY --from=STAGE PATH takes (the builders put theirs in
# /out).
source_file() {
  case $1 in
    "$cargo_stage") echo "$bin_dir/${2#/out/}" ;;
    "$hook_stage") echo "$hook" ;;
    *) rt_log "no builder stage $1"; return 1 ;;
  esac
}

images=()
while IFS=$'\t' read -r kind stage a b c; do
  [[ $kind == copy ]] || continue
  src=$(source_file "$a" "$b")
  mkdir -p "$work/$stage/${c%/*}"
  cp -p "$src" "$work/$stage/$c"
done <<<"$plan"
while IFS=$'\t' read -r kind stage name config; do
  [[ $kind == image ]] || continue
  mkdir -p "$work/$stage"
  workdir=$(python3 -c 'import json, sys; print(json.loads(sys.argv[1]).get("WorkingDir", ""))' "$config")
  [[ -z $workdir ]] || mkdir -p "$work/$stage/$workdir"
  rt_layer "$work/$stage" "$work/$stage.tar.gz"
  rt_oci_layers "$name" "$config" "$out/$stage.tar" "$base/layer.tar.gz" "$work/$stage.tar.gz"
  images+=("$name" "$out/$stage.tar")
done <<<"$plan"

mkdir -p "$work/gpu-probe/usr/local/bin"
gcc -O2 -Wall -Wextra -Werror -s -o "$work/gpu-probe/usr/local/bin/gpu-probe" "$here/gpu-probe/gpu-probe.c"
rt_layer "$work/gpu-probe" "$work/gpu-probe.tar.gz"
rt_oci_layers "$probe_image" \
  '{"Env":["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],"Entrypoint":["/usr/local/bin/gpu-probe"]}' \
  "$out/gpu-probe.tar" "$base/layer.tar.gz" "$work/gpu-probe.tar.gz"
images+=("$probe_image" "$out/gpu-probe.tar")

printf '%s\t%s\n' "${images[@]}" >"$out/images.txt"
touch "$out/.complete"
# Images of earlier sources: dropped a day after they were built.
find "$cache_root/migdra-images" -mindepth 1 -maxdepth 1 -type d ! -name "$key" -mmin +1440 -exec rm -rf {} +
rt_log "built $((${#images[@]} / 2)) images in $out"
echo "$out"
