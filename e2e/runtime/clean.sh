#!/usr/bin/env bash
# Cleans up after the e2e cluster's containerd (e2e/suite/src/cluster/containerd.rs), whether
# the run ended or was killed: `clean.sh DIR [ALIAS...]`, where DIR is the run's containerd
# directory and the ALIASes are other paths of it (the run dir's short /tmp link).
#
# Force-deletes the pods' containers runc still has (runc root DIR/runc), stops containerd, its
# shims, the socat relays and the loopback registry (crane serving DIR/registry) (the processes
# whose command line names DIR or an ALIAS), unmounts everything
# below DIR (the node's network namespace; containerd's own mounts are in its mount
# namespace, which ends with it) and the run's kubelet root (DIR/../kubelet, and the short
# directory DIR/kubelet-root names, which it then removes), removes the
# kubelet's cgroup root (DIR/cgroup-root names it, in every cgroup hierarchy) and the
# cgroups the run created above it (DIR/cgroups-created), containerd's state and the
# registry's blobs; keeps the configs and the logs. Writes DIR/cleaned when done; fails if mounts stay.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$here/lib.sh"

[[ $# -ge 1 ]] || { rt_log "usage: clean.sh DIR [ALIAS...]"; exit 2; }
[[ $(id -u) == 0 ]] || { rt_log "needs root"; exit 1; }
dir=${1%/}
[[ -d $dir ]] || exit 0
real=$(realpath "$dir")
case $real in */ctrd) ;; *) rt_log "not a run's containerd directory: $real"; exit 1 ;; esac
patterns=("$dir/" "$real/")
for a in "${@:2}"; do patterns+=("${a%/}/"); done

bin=$("$here/build.sh")
rt_stop_runtime "$bin/runc" "$real/runc" "${patterns[@]}"
rt_unmount_under "$real"
# The run made its kubelet root a shared bind mount (for containerd's namespace): on itself,
# or on the short directory DIR/kubelet-root names, which goes too.
rt_unmount_under "$(dirname "$real")/kubelet"
if [[ -f $real/kubelet-root ]]; then
  short_root=$(cat "$real/kubelet-root")
  if [[ $short_root == /tmp/mk-* ]]; then
    rt_unmount_under "$short_root"
    rmdir "$short_root" 2>/dev/null || true
  fi
fi

if [[ -f $real/cgroup-root ]]; then
  root=$(cat "$real/cgroup-root")
  if [[ $root == /*/migdra-e2e-* ]] || [[ $root == /migdra-e2e-* ]]; then
    for m in $(rt_cgroup_mounts); do
      rt_rmdir_cgroup_tree "$m$root"
    done
  fi
fi
if [[ -f $real/cgroups-created ]]; then
  # Created top-down; removed bottom-up, each only when empty.
  tac "$real/cgroups-created" | while read -r d; do
    case $d in /sys/fs/cgroup/?*) rmdir "$d" 2>/dev/null || true ;; esac
  done
fi
left=$(for m in $(rt_cgroup_mounts); do [[ -n ${root:-} && -d $m$root ]] && echo "$m$root"; done || true)
[[ -z $left ]] || rt_log "cgroups left (not empty): $left"

for d in root state tmp runc s opt registry/blobs; do
  rm -rf --one-file-system "${real:?}/$d"
done
touch "$real/cleaned"
