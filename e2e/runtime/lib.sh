# shellcheck shell=bash
# Functions shared by smoke.sh, images.sh and clean.sh (sourced, not run). They only touch
# what lies under the directories they are given: processes are found by their executable's
# name and a command line naming one of those directories, mounts by their mount point.

rt_log() { echo "${0##*/}: $*" >&2; }

# rt_our_pids PATTERN...: pids of containerd, containerd-shim-runc-v2 and socat (the e2e
# cluster's relays into the node's network namespace) processes whose command line contains
# one of the PATTERNs (our run dirs, with a trailing slash).
rt_our_pids() {
  local p exe cmdline pattern
  for p in /proc/[0-9]*; do
    exe=$(readlink "$p/exe" 2>/dev/null) || continue
    case ${exe##*/} in containerd | containerd-shim-runc-v2 | socat) ;; *) continue ;; esac
    cmdline=$(tr '\0' ' ' <"$p/cmdline" 2>/dev/null) || continue
    for pattern in "$@"; do
      if [[ $cmdline == *"$pattern"* ]]; then
        echo "${p#/proc/}"
        break
      fi
    done
  done
  return 0
}

# rt_stop_runtime RUNC RUNC_ROOT PATTERN...: force-deletes the containers runc keeps under
# RUNC_ROOT (one root per containerd namespace), then stops containerd and its shims (those
# rt_our_pids finds): SIGTERM, then SIGKILL after 10s.
rt_stop_runtime() {
  local runc=$1 runc_root=$2 d i pid
  shift 2
  if [[ -x $runc && -d $runc_root ]]; then
    for d in "$runc_root"/*/; do
      [[ -d $d ]] || continue
      for i in $("$runc" --root "$d" list -q 2>/dev/null); do
        "$runc" --root "$d" delete --force "$i" >/dev/null 2>&1 || true
      done
    done
  fi
  for pid in $(rt_our_pids "$@"); do
    kill -TERM "$pid" 2>/dev/null || true
  done
  for _ in $(seq 50); do
    [[ -z $(rt_our_pids "$@") ]] && break
    sleep 0.2
  done
  for pid in $(rt_our_pids "$@"); do
    rt_log "killing leftover pid $pid"
    kill -KILL "$pid" 2>/dev/null || true
  done
}

# rt_mounts_under DIR: mount points at or below DIR (a real path), deepest first.
rt_mounts_under() {
  awk -v d="${1%/}" -v r="${1%/}/" '$5 == d || index($5, r) == 1 {print $5}' /proc/self/mountinfo | sort -r
}

# rt_unmount_under DIR: unmounts everything at or below DIR (a real path); fails, listing them,
# when some mounts stay.
rt_unmount_under() {
  local m d
  for _ in 1 2 3; do
    m=$(rt_mounts_under "$1")
    [[ -z $m ]] && return 0
    while read -r d; do
      umount "$d" 2>/dev/null || umount -l "$d" 2>/dev/null || true
    done <<<"$m"
  done
  m=$(rt_mounts_under "$1")
  [[ -z $m ]] && return 0
  rt_log "mounts left under $1:"
  echo "$m" >&2
  return 1
}

# rt_rmdir_cgroup_tree DIR: removes the cgroup DIR and the cgroups below it, deepest first
# (only empty cgroups can go; the others stay, silently).
rt_rmdir_cgroup_tree() {
  if [[ -d $1 ]]; then find "$1" -depth -type d -exec rmdir {} + 2>/dev/null || true; fi
}

# rt_cgroup_mounts: mount points of the cgroup hierarchies, v1 and v2 (runc also makes a
# container's cgroup in a hybrid host's cgroup2 hierarchy, /sys/fs/cgroup/unified).
rt_cgroup_mounts() {
  awk '{for (i = 7; $i != "-"; i++); if ($(i + 1) == "cgroup" || $(i + 1) == "cgroup2") print $5}' /proc/self/mountinfo
}

# rt_oci_image ROOTFS NAME CONFIG OUT: writes OUT, an OCI image layout tarball (for `ctr images
# import`) of one layer holding ROOTFS, named NAME; CONFIG is the image config's "config"
# object (JSON). Reproducible: the same inputs give the same digests.
rt_oci_image() {
  local rootfs=$1 name=$2 config=$3 out=$4 work oci diff_id layer_d layer_s config_d config_s manifest_d manifest_s
  work=$(mktemp -d "${out%/*}/.oci.XXXXXX")
  oci=$work/oci
  mkdir -p "$oci/blobs/sha256"
  _rt_blob() { # file -> prints "sha256 size", and stores the file as a blob
    local d s
    d=$(sha256sum <"$1" | cut -d' ' -f1)
    s=$(stat -c %s "$1")
    mv "$1" "$oci/blobs/sha256/$d"
    echo "$d $s"
  }
  tar -C "$rootfs" --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -cf "$work/layer.tar" .
  diff_id=$(sha256sum <"$work/layer.tar" | cut -d' ' -f1)
  gzip -n -c "$work/layer.tar" >"$work/layer.tar.gz"
  read -r layer_d layer_s < <(_rt_blob "$work/layer.tar.gz")
  printf '%s' '{"architecture":"amd64","os":"linux","config":'"$config"',"rootfs":{"type":"layers","diff_ids":["sha256:'"$diff_id"'"]}}' >"$work/config.json"
  read -r config_d config_s < <(_rt_blob "$work/config.json")
  printf '%s' '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"sha256:'"$config_d"'","size":'"$config_s"'},"layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar+gzip","digest":"sha256:'"$layer_d"'","size":'"$layer_s"'}]}' >"$work/manifest.json"
  read -r manifest_d manifest_s < <(_rt_blob "$work/manifest.json")
  printf '%s' '{"imageLayoutVersion":"1.0.0"}' >"$oci/oci-layout"
  printf '%s' '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json","manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:'"$manifest_d"'","size":'"$manifest_s"',"platform":{"architecture":"amd64","os":"linux"},"annotations":{"io.containerd.image.name":"'"$name"'","org.opencontainers.image.ref.name":"'"${name##*:}"'"}}]}' >"$oci/index.json"
  tar -C "$oci" --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -cf "$out" .
  rm -rf "$work"
}

# rt_busybox_rootfs DIR: a root filesystem of Debian's static busybox with all its applets.
rt_busybox_rootfs() {
  local busybox=/bin/busybox a
  if ! dpkg -s busybox-static >/dev/null 2>&1 && command -v apt-get >/dev/null && [[ $(id -u) == 0 ]]; then
    rt_log "installing busybox-static"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq busybox-static >&2
  fi
  grep -q 'not a dynamic' < <(LC_ALL=C ldd "$busybox" 2>&1) ||
    { rt_log "needs a static $busybox (Debian: busybox-static)"; return 1; }
  mkdir -p "$1"/{bin,dev,proc,sys,etc,tmp,root}
  cp "$busybox" "$1/bin/busybox"
  for a in $("$busybox" --list); do
    [[ $a == busybox ]] || ln -s busybox "$1/bin/$a"
  done
  printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n' >"$1/etc/passwd"
  printf 'root:x:0:\nnogroup:x:65534:\n' >"$1/etc/group"
}
