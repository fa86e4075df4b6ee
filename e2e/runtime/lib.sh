# shellcheck shell=bash
# Functions shared by smoke.sh, images.sh, migdra-images.sh and clean.sh (sourced, not run). They only touch
# what lies under the directories they are given: processes are found by their executable's
# name and a command line naming one of those directories, mounts by their mount point.

rt_log() { echo "${0##*/}: $*" >&2; }

# rt_our_pids PATTERN...: pids of containerd, containerd-shim-runc-v2, socat (the e2e
# cluster's relays into the node's network namespace) and crane (its loopback registry,
# registry.sh) processes whose command line contains
# one of the PATTERNs (our run dirs, with a trailing slash).
rt_our_pids() {
  local p exe cmdline pattern
  for p in /proc/[0-9]*; do
    exe=$(readlink "$p/exe" 2>/dev/null) || continue
    case ${exe##*/} in containerd | containerd-shim-runc-v2 | socat | crane) ;; *) continue ;; esac
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

# rt_layer ROOTFS OUT [keep-owners]: writes OUT, a gzip'd tar of ROOTFS (an image layer), and
# OUT.diffid, the sha256 of the uncompressed tar. Files belong to root unless keep-owners is
# given (a root filesystem made as root, whose owners are meant). Reproducible: the same
# inputs give the same digests.
rt_layer() {
  local owners=(--owner=0 --group=0)
  [[ ${3:-} == keep-owners ]] && owners=()
  tar -C "$1" --sort=name --mtime=@0 "${owners[@]}" --numeric-owner -cf "$2.tar" .
  sha256sum <"$2.tar" | cut -d' ' -f1 >"$2.diffid"
  gzip -n -c "$2.tar" >"$2"
  rm "$2.tar"
}

# rt_oci_layers NAME CONFIG OUT LAYER...: writes OUT, an OCI image layout tarball (for `ctr
# images import`) named NAME, of the LAYERs (made by rt_layer, bottom first); CONFIG is the
# image config's "config" object (JSON).
rt_oci_layers() {
  local name=$1 config=$2 out=$3 work oci layer d s layers="" diff_ids="" config_d config_s manifest_d manifest_s
  shift 3
  work=$(mktemp -d "${out%/*}/.oci.XXXXXX")
  oci=$work/oci
  mkdir -p "$oci/blobs/sha256"
  _rt_blob() { # file -> prints "sha256 size", and stores a copy of the file as a blob
    local d s
    d=$(sha256sum <"$1" | cut -d' ' -f1)
    s=$(stat -c %s "$1")
    cp "$1" "$oci/blobs/sha256/$d"
    echo "$d $s"
  }
  for layer in "$@"; do
    read -r d s < <(_rt_blob "$layer")
    layers+=${layers:+,}'{"mediaType":"application/vnd.oci.image.layer.v1.tar+gzip","digest":"sha256:'"$d"'","size":'"$s"'}'
    diff_ids+=${diff_ids:+,}'"sha256:'"$(cat "$layer.diffid")"'"'
  done
  printf '%s' '{"architecture":"amd64","os":"linux","config":'"$config"',"rootfs":{"type":"layers","diff_ids":['"$diff_ids"']}}' >"$work/config.json"
  read -r config_d config_s < <(_rt_blob "$work/config.json")
  printf '%s' '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"sha256:'"$config_d"'","size":'"$config_s"'},"layers":['"$layers"']}' >"$work/manifest.json"
  read -r manifest_d manifest_s < <(_rt_blob "$work/manifest.json")
  printf '%s' '{"imageLayoutVersion":"1.0.0"}' >"$oci/oci-layout"
  printf '%s' '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json","manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:'"$manifest_d"'","size":'"$manifest_s"',"platform":{"architecture":"amd64","os":"linux"},"annotations":{"io.containerd.image.name":"'"$name"'","org.opencontainers.image.ref.name":"'"${name##*:}"'"}}]}' >"$oci/index.json"
  tar -C "$oci" --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -cf "$out" .
  rm -rf "$work"
}

# rt_oci_image ROOTFS NAME CONFIG OUT: rt_oci_layers with one layer holding ROOTFS.
rt_oci_image() {
  local work
  work=$(mktemp -d "${4%/*}/.layer.XXXXXX")
  rt_layer "$1" "$work/layer.tar.gz"
  rt_oci_layers "$2" "$3" "$4" "$work/layer.tar.gz"
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
