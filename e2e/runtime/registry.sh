#!/usr/bin/env bash
# An image registry on loopback for the e2e cluster, so the kubelet's image pull path runs:
#
#   registry.sh start DIR ADDR [NETNS] [IMAGES_DIR...]
#       serves a registry on ADDR (e.g. 127.0.0.1:5000) with its blobs under DIR, then pushes
#       every image of each IMAGES_DIR's images.txt (migdra-images.sh, images.sh) to it under
#       its own repository path: ghcr.io/migdra/migdra-controller:0.1.0 becomes
#       ADDR/migdra/migdra-controller:0.1.0, migdra.dev/e2e/gpu-probe:e2e becomes
#       ADDR/e2e/gpu-probe:e2e. With NETNS (a network namespace file, e.g. the e2e node's
#       <run>/ctrd/netns/node) the registry runs, and pushes, inside that namespace, where
#       containerd reaches it; "-" means the caller's namespace. Writes DIR/hosts/ADDR/hosts.toml
#       (plain HTTP, pull and resolve) for containerd's registry config_path = DIR/hosts, and
#       DIR/pushed.txt: "source name<TAB>pushed name" lines. Prints DIR.
#   registry.sh stop DIR
#       stops the registry started with DIR (its pid is in DIR/registry.pid).
#
# The registry and the pusher are go-containerregistry's crane (`crane registry serve`: manifests
# in memory, blobs on disk), built from the Go module proxy at the version crane/go.mod pins and
# cached in ${MIGDRA_CACHE_DIR:-~/.cache/migdra}/crane/<version>-<key>.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$here/lib.sh"

crane_binary() {
  local version key out
  version=$(grep -oE '^require github.com/google/go-containerregistry v[^ ]+' "$here/crane/go.mod" | cut -d' ' -f3)
  [[ -n $version ]] || { rt_log "cannot read the pinned go-containerregistry version"; return 1; }
  key=$( (cat "$here/crane/go.mod" "$here/crane/go.sum"; go version) | sha256sum | cut -c1-12)
  out=${MIGDRA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/migdra}/crane/$version-$key
  if [[ ! -f $out/.complete ]]; then
    rm -rf "$out"
    mkdir -p "$out"
    GOFLAGS="-mod=mod -buildvcs=false" CGO_ENABLED=0 go -C "$here/crane" build -trimpath \
      -ldflags "-s -w -X github.com/google/go-containerregistry/cmd/crane/cmd.Version=$version" \
      -o "$out/crane" github.com/google/go-containerregistry/cmd/crane >&2
    touch "$out/.complete"
  fi
  echo "$out/crane"
}

# pushed_name NAME ADDR: NAME under the registry ADDR, its registry host dropped.
pushed_name() {
  local path=${1#*/}
  echo "$2/$path"
}

usage() {
  echo "usage: registry.sh start DIR ADDR [NETNS|-] [IMAGES_DIR...] | stop DIR" >&2
  exit 2
}

start() {
  local dir=$1 addr=$2 netns=${3:--} crane pid in_ns=() images_dir name tarball layout target
  shift 2
  (($# == 0)) || shift
  crane=$(crane_binary)
  [[ $netns == - ]] || in_ns=(nsenter "--net=$netns")
  mkdir -p "$dir/blobs" "$dir/hosts/$addr"
  dir=$(cd "$dir" && pwd)
  if [[ -f $dir/registry.pid ]] && kill -0 "$(cat "$dir/registry.pid")" 2>/dev/null; then
    rt_log "a registry already runs for $dir (pid $(cat "$dir/registry.pid"))"
    return 1
  fi
  printf 'server = "http://%s"\n\n[host."http://%s"]\n  capabilities = ["pull", "resolve"]\n' "$addr" "$addr" \
    >"$dir/hosts/$addr/hosts.toml"
  "${in_ns[@]}" "$crane" registry serve --address "$addr" --disk "$dir/blobs" >"$dir/registry.log" 2>&1 &
  pid=$!
  echo "$pid" >"$dir/registry.pid"
  for _ in $(seq 100); do
    grep -q 'serving on port' "$dir/registry.log" && break
    kill -0 "$pid" 2>/dev/null || { rt_log "the registry exited:"; cat "$dir/registry.log" >&2; return 1; }
    sleep 0.1
  done
  grep -q 'serving on port' "$dir/registry.log" || { rt_log "the registry did not start"; return 1; }
  : >"$dir/pushed.txt"
  for images_dir in "$@"; do
    while IFS=$'\t' read -r name tarball; do
      layout=$(mktemp -d "$dir/.layout.XXXXXX")
      tar -C "$layout" -xf "$tarball"
      target=$(pushed_name "$name" "$addr")
      "${in_ns[@]}" "$crane" push --insecure "$layout" "$target" >/dev/null 2>"$dir/push.log" ||
        { rt_log "pushing $name as $target failed:"; cat "$dir/push.log" >&2; return 1; }
      rm -rf "$layout"
      printf '%s\t%s\n' "$name" "$target" >>"$dir/pushed.txt"
    done <"$images_dir/images.txt"
  done
  rt_log "registry on $addr (pid $pid), pushed $(wc -l <"$dir/pushed.txt") images"
  echo "$dir"
}

stop() {
  local dir=$1 pid
  [[ -f $dir/registry.pid ]] || return 0
  pid=$(cat "$dir/registry.pid")
  # Only a crane process serving this dir is ours to stop.
  if [[ $(readlink "/proc/$pid/exe" 2>/dev/null) == */crane ]] && tr '\0' ' ' <"/proc/$pid/cmdline" | grep -qF -- "--disk $dir/blobs"; then
    kill -TERM "$pid"
    for _ in $(seq 50); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$dir/registry.pid"
}

case ${1:-} in
  start) (($# >= 3)) || usage; shift; start "$@" ;;
  stop) (($# == 2)) || usage; stop "$(cd "$2" && pwd)" ;;
  *) usage ;;
esac
