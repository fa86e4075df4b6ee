#!/usr/bin/env bash
# Builds the local images the e2e cluster's containerd runs, as OCI image layout tarballs
# (for `ctr images import`), into ${MIGDRA_CACHE_DIR:-~/.cache/migdra}/runtime-images/<key>,
# and prints that directory. It holds images.txt, one "name<TAB>tarball" line per image:
#
#   migdra.dev/e2e/pause:e2e    the pod sandbox image: pause/pause.c built static with gcc
#                               (waits, reaps orphans, exits on SIGINT/SIGTERM)
#   migdra.dev/e2e/busybox:e2e  Debian's static busybox with all its applets, /bin/sh as Cmd
#
# A warm cache (the .complete stamp) returns at once; the key covers the sources, this
# script, lib.sh, the busybox package version and gcc's version.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$here/lib.sh"
pause_image=migdra.dev/e2e/pause:e2e
busybox_image=migdra.dev/e2e/busybox:e2e

for t in gcc tar gzip sha256sum; do
  command -v "$t" >/dev/null || { rt_log "needs $t"; exit 1; }
done
busybox_version=$(dpkg-query -W -f '${Version}' busybox-static 2>/dev/null || echo none)
cache_root=${MIGDRA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/migdra}
key=$( (cat "$here/pause/pause.c" "$here/lib.sh" "$0"; echo "$busybox_version"; gcc --version | sed -n 1p) | sha256sum | cut -c1-12)
out=$cache_root/runtime-images/$key
if [[ -f $out/.complete ]]; then
  echo "$out"
  exit 0
fi

rm -rf "$out"
mkdir -p "$out"
work=$(mktemp -d "$out/.build.XXXXXX")
trap 'rm -rf "$work"' EXIT

mkdir -p "$work/pause"
gcc -static -Os -Wall -Wextra -Werror -s -o "$work/pause/pause" "$here/pause/pause.c"
"$work/pause/pause" -v >/dev/null
rt_oci_image "$work/pause" "$pause_image" '{"Entrypoint":["/pause"],"WorkingDir":"/"}' "$out/pause.tar"

rt_busybox_rootfs "$work/busybox"
rt_oci_image "$work/busybox" "$busybox_image" '{"Env":["PATH=/bin"],"Cmd":["/bin/sh"],"WorkingDir":"/"}' "$out/busybox.tar"

printf '%s\t%s\n' "$pause_image" "$out/pause.tar" "$busybox_image" "$out/busybox.tar" >"$out/images.txt"
touch "$out/.complete"
rt_log "built $pause_image and $busybox_image"
echo "$out"
