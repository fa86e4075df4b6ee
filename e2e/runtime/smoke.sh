#!/usr/bin/env bash
# Smoke test of the real container runtime that build.sh builds: starts containerd
# (config version 3) with its root, state, sockets, shim sockets and runc root all
# under one run directory, imports a busybox image made here from Debian's
# busybox-static (an OCI layout tarball written by hand), runs a container that
# prints its cgroups, ids and /dev (and checks the devices cgroup denies a node
# it was not given), runs one with a CDI device, wires a network namespace with
# the CNI plugins and pings from a container in it, then stops containerd and
# unmounts everything. Needs root. A run killed half-way is cleaned up by the
# next one (and by `smoke.sh clean`). containerd's log of the last run is kept
# beside the run dir, as RUN_DIR.containerd.log. With MIGDRA_RT_SMOKE_IMAGES=<the directory
# migdra-images.sh printed> it also runs migdra's images and the probe.
#
# Nothing outside the run directory is changed: no cgroup mounts, no host network
# setup, no iptables, no system services. Network namespaces are bind-mounted on
# files in the run dir. Containers get relative cgroup paths, so runc nests them
# under this script's own cgroups (cgroupfs driver, not systemd).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
run=${MIGDRA_RT_RUN_DIR:-/tmp/migdra-rt-check/run}
ns=migdra-smoke
cg=migdra-rt-check
image=migdra.dev/e2e/busybox:smoke

[[ $(id -u) == 0 ]] || { echo "smoke.sh: needs root" >&2; exit 1; }
for t in unshare nsenter ip tar gzip sha256sum; do
  command -v "$t" >/dev/null || { echo "smoke.sh: needs $t (util-linux, iproute2, tar, gzip, coreutils)" >&2; exit 1; }
done
case $run in /tmp/?*) ;; *) echo "smoke.sh: run dir must be under /tmp: $run" >&2; exit 1 ;; esac

# shellcheck source-path=SCRIPTDIR source=lib.sh
. "$here/lib.sh"
log() { rt_log "$@"; }

cleanup() {
  local real ctrl path d
  # Containers left by a killed run, then containerd and its shims (found by our run dir).
  rt_stop_runtime "${bin:-}/runc" "$run/runc" "$run/"
  # Unmount everything under the run dir, deepest first.
  real=$(realpath -m "$run")
  rt_unmount_under "$real" || return 1
  # Our cgroups (empty once the containers are gone), under our own cgroup of each hierarchy.
  while IFS=: read -r _ ctrl path; do
    d=/sys/fs/cgroup/${ctrl#name=}
    [[ -z $ctrl ]] && d=/sys/fs/cgroup/unified
    rt_rmdir_cgroup_tree "$d${path%/}/$cg"
  done </proc/self/cgroup
  if [[ -f $run/containerd.log ]]; then cp "$run/containerd.log" "${run%/}.containerd.log"; fi
  rm -rf --one-file-system "$run"
}

if [[ ${1:-} == clean ]]; then
  bin=$("$here/build.sh")
  cleanup
  exit 0
fi

bin=$("$here/build.sh")
"$bin/runc" --version | sed -n 1p >&2
"$bin/containerd" --version >&2
cleanup
on_exit() {
  local rc=$?
  trap - EXIT INT TERM
  cleanup || rc=1
  exit "$rc"
}
trap on_exit EXIT
trap 'exit 130' INT TERM

mkdir -p "$run"/{root,state,runc,fifo,tmp,opt,cni/net.d,cdiroot/cdi,image}
sock=$run/containerd.sock

# The config e2e/runtime/containerd.toml shares with the e2e cluster; ctr needs no sandbox
# image and this process may keep its OOM score adjustments.
sed -e "s|@RUN@|$run|g" -e "s|@BIN@|$bin|g" -e "s|@CDI_DIR@|$run/cdiroot/cdi|g" \
  -e "s|@SANDBOX_IMAGE@|migdra.dev/e2e/pause:e2e|g" -e "s|@RESTRICT_OOM_SCORE_ADJ@|false|g" \
  "$here/containerd.toml" >"$run/containerd.toml"

log "starting containerd (log: $run/containerd.log)"
PATH=$bin:$PATH TMPDIR=$run/tmp "$bin/containerd" --config "$run/containerd.toml" \
  >"$run/containerd.log" 2>&1 &
echo $! >"$run/containerd.pid"
ctr() { "$bin/ctr" --address "$sock" --namespace "$ns" "$@"; }
for _ in $(seq 100); do
  ctr version >/dev/null 2>&1 && break
  kill -0 "$(cat "$run/containerd.pid")" 2>/dev/null || { tail -20 "$run/containerd.log" >&2; exit 1; }
  sleep 0.2
done
ctr version >&2
plugins=$(ctr plugins ls)
if grep -E '\s(error|skip)\s*$' <<<"$plugins" >&2; then
  log "(plugins above did not load; the overlayfs snapshotter and the CRI plugins must not be among them)"
fi
for p in 'io\.containerd\.snapshotter\.v1\s+overlayfs' 'io\.containerd\.grpc\.v1\s+cri' 'io\.containerd\.cri\.v1\s+runtime'; do
  grep -qE "^$p\s.*\sok\s*$" <<<"$plugins" || { log "plugin $p not loaded"; exit 1; }
done

# An OCI image layout tarball of a busybox-static root filesystem, written by hand.
rootfs=$run/image/rootfs
rt_busybox_rootfs "$rootfs"
rt_oci_image "$rootfs" "$image" '{"Env":["PATH=/bin"],"Cmd":["/bin/sh"],"WorkingDir":"/"}' "$run/image/busybox-oci.tar"

ctr images import --snapshotter overlayfs "$run/image/busybox-oci.tar" >&2
ctr images ls >&2

runflags=(--rm --snapshotter overlayfs --runc-binary "$bin/runc" --runc-root "$run/runc"
  --fifo-dir "$run/fifo")

log "container 1: /proc/self/cgroup, id, ls -l /dev"
out=$(ctr run "${runflags[@]}" --seccomp --cgroup "$cg/smoke-1" "$image" smoke-1 \
  sh -c 'echo "== /proc/self/cgroup"; cat /proc/self/cgroup; echo "== id"; id; echo "== ls -l /dev"; ls -l /dev
    echo "== seccomp (containerd default profile)"; grep Seccomp: /proc/self/status
    echo "== devices cgroup: reading a fresh node for char 1:1 (/dev/mem), not in the allow list"
    mknod /tmp/mem c 1 1 && head -c1 /tmp/mem 2>&1 >/dev/null || true')
echo "$out"
grep -q 'head: /tmp/mem: Operation not permitted' <<<"$out" || { log "devices cgroup did not deny 1:1"; exit 1; }
grep -q "memory:.*/$cg/smoke-1" <<<"$out" || { log "container not in its own memory cgroup"; exit 1; }
grep -q 'uid=0(root) gid=0(root)' <<<"$out" || { log "unexpected id"; exit 1; }
grep -qE '^Seccomp:\s+2$' <<<"$out" || { log "seccomp filter not applied"; exit 1; }

# CDI: a spec under the run dir adding /dev/null's node (char 1:3) under another name.
# containerd's CRI plugin reads cdi_spec_dirs from the config above; ctr resolves CDI
# names itself from the fixed dirs /etc/cdi and /var/run/cdi, so ctr runs in a
# private mount namespace where the run dir's cdiroot is bind-mounted over /run.
cat >"$run/cdiroot/cdi/migdra-smoke.json" <<'EOF'
{
  "cdiVersion": "0.6.0",
  "kind": "migdra.dev/smoke",
  "devices": [
    {
      "name": "null0",
      "containerEdits": {
        "env": ["MIGDRA_SMOKE_CDI=null0"],
        "deviceNodes": [
          {"path": "/dev/migdra-null0", "hostPath": "/dev/null", "type": "c", "major": 1, "minor": 3, "permissions": "rw"}
        ]
      }
    }
  ]
}
EOF
log "container 2: CDI device migdra.dev/smoke=null0"
# shellcheck disable=SC2016 # both scripts expand inside the container / the new shell
out=$(unshare --mount --propagation private -- bash -c 'mount --bind "$1" /run && shift && exec "$@"' _ \
  "$run/cdiroot" "$bin/ctr" --address "$sock" --namespace "$ns" run "${runflags[@]}" \
  --cgroup "$cg/smoke-2" --device migdra.dev/smoke=null0 "$image" smoke-2 \
  sh -c 'ls -l /dev/migdra-null0 && echo "env MIGDRA_SMOKE_CDI=$MIGDRA_SMOKE_CDI" && echo x >/dev/migdra-null0 && echo "write ok"')
echo "$out"
grep -qE '^crw-rw-rw-\s+1 root\s+root\s+1,\s+3 .*/dev/migdra-null0$' <<<"$out" || { log "CDI device node missing"; exit 1; }
grep -q 'env MIGDRA_SMOKE_CDI=null0' <<<"$out" || { log "CDI env edit missing"; exit 1; }
grep -q 'write ok' <<<"$out" || { log "CDI device not writable"; exit 1; }

# CNI: bridge + host-local + loopback, run by hand (as the CRI plugin would) from inside
# a "node" network namespace made here, for a "pod" network namespace made here; both
# are bind-mounted on files under the run dir. Nothing touches the host's namespace;
# no masquerading (no iptables); the only traffic is one ping inside these namespaces.
log "CNI: bridge/host-local/loopback between two network namespaces under the run dir"
mkdir -p "$run/netns" "$run/cni/ipam"
for n in node pod; do
  touch "$run/netns/$n"
  unshare --net="$run/netns/$n" true
done
nsenter --net="$run/netns/node" ip link set lo up
cat >"$run/cni/net.d/10-migdra-smoke.conf" <<CONF
{
  "cniVersion": "1.0.0",
  "name": "migdra-smoke",
  "type": "bridge",
  "bridge": "migdra0",
  "isGateway": true,
  "ipMasq": false,
  "ipam": {
    "type": "host-local",
    "ranges": [[{"subnet": "10.88.0.0/24"}]],
    "dataDir": "$run/cni/ipam"
  }
}
CONF
printf '%s' '{"cniVersion":"1.0.0","name":"lo","type":"loopback"}' >"$run/cni/net.d/99-loopback.conf"
cni() { # command plugin ifname conf
  nsenter --net="$run/netns/node" env CNI_COMMAND="$1" CNI_CONTAINERID=smoke-3 \
    CNI_NETNS="$run/netns/pod" CNI_IFNAME="$3" CNI_PATH="$bin" "$bin/$2" <"$4"
}
cni ADD loopback lo "$run/cni/net.d/99-loopback.conf" >/dev/null
cni ADD bridge eth0 "$run/cni/net.d/10-migdra-smoke.conf" >"$run/cni/result.json"
pod_ip=$(grep -oE '"address": *"[0-9.]+/' "$run/cni/result.json" | sed -n 1p | grep -oE '[0-9.]+/' | tr -d /)
gw=$(grep -oE '"gateway": *"[0-9.]+"' "$run/cni/result.json" | sed -n 1p | grep -oE '[0-9.]+')
[[ -n $pod_ip && -n $gw ]] || { cat "$run/cni/result.json" >&2; log "no address in the CNI result"; exit 1; }
log "pod address $pod_ip, gateway $gw"
if ip link show migdra0 >/dev/null 2>&1; then log "bridge leaked into the host network namespace"; exit 1; fi
out=$(ctr run "${runflags[@]}" --cgroup "$cg/smoke-3" --with-ns "network:$run/netns/pod" "$image" smoke-3 \
  sh -c "ip -4 addr show eth0; ping -c 1 -W 2 $gw")
echo "$out"
grep -q "inet $pod_ip/24" <<<"$out" || { log "pod address not on eth0 in the container"; exit 1; }
grep -q '1 packets received' <<<"$out" || { log "no ping reply from the bridge"; exit 1; }
cni DEL bridge eth0 "$run/cni/net.d/10-migdra-smoke.conf"
cni DEL loopback lo "$run/cni/net.d/99-loopback.conf"

# migdra's images, when MIGDRA_RT_SMOKE_IMAGES names a directory migdra-images.sh printed: each
# image's binary starts from its root filesystem as the image's user, the plugin image's
# nvidia-cdi-hook runs, and the probe reports a CDI device node and its env.
if [[ -n ${MIGDRA_RT_SMOKE_IMAGES:-} ]]; then
  while IFS=$'\t' read -r _ tarball; do
    ctr images import --snapshotter overlayfs "$tarball" >&2
  done <"$MIGDRA_RT_SMOKE_IMAGES/images.txt"
  n=4
  in_image() { # image command...: runs command in a container of image, prints its output
    local image=$1
    shift
    n=$((n + 1))
    ctr run "${runflags[@]}" --cgroup "$cg/smoke-$n" "$image" "smoke-$n" "$@"
  }
  plugin=ghcr.io/migdra/migdra-kubelet-plugin:0.1.0
  controller=ghcr.io/migdra/migdra-controller:0.1.0
  log "migdra images: $plugin --help, nvidia-cdi-hook --version"
  out=$(in_image "$plugin" sh -c 'id -u; migdra-kubelet-plugin --help; nvidia-cdi-hook --version')
  echo "$out" | sed -n '1,3p;/NVIDIA CDI Hook/p'
  grep -qx 0 <<<"$out" || { log "the plugin does not run as root"; exit 1; }
  grep -q -- '--nvidia-cdi-hook-path' <<<"$out" || { log "migdra-kubelet-plugin --help failed in its image"; exit 1; }
  grep -q '^NVIDIA CDI Hook version v' <<<"$out" || { log "nvidia-cdi-hook does not run in the plugin image"; exit 1; }
  log "migdra images: $controller --help as its user"
  out=$(in_image "$controller" sh -c 'id -u; migdra-controller --help')
  echo "$out" | sed -n '1,3p'
  grep -qx 65532 <<<"$out" || { log "the controller does not run as 65532"; exit 1; }
  grep -q 'Usage' <<<"$out" || { log "migdra-controller --help failed in its image"; exit 1; }
  out=$(in_image ghcr.io/migdra/kubectl-migdra:0.1.0 kubectl-migdra --help)
  grep -q 'Usage' <<<"$out" || { log "kubectl-migdra --help failed in its image"; exit 1; }
  log "migdra images: gpu-probe with a CDI device"
  cat >"$run/cdiroot/cdi/migdra-smoke-cap.json" <<'SPEC'
{
  "cdiVersion": "0.6.0",
  "kind": "migdra.dev/smoke-cap",
  "devices": [
    {
      "name": "cap",
      "containerEdits": {
        "env": ["NVIDIA_VISIBLE_DEVICES=void", "MIGDRA_SMOKE=cap"],
        "deviceNodes": [
          {"path": "/dev/nvidia-caps/nvidia-cap21", "hostPath": "/dev/null", "type": "c", "major": 1, "minor": 3}
        ]
      }
    }
  ]
}
SPEC
  # shellcheck disable=SC2016 # expands in the new shell
  out=$(unshare --mount --propagation private -- bash -c 'mount --bind "$1" /run && shift && exec "$@"' _ \
    "$run/cdiroot" "$bin/ctr" --address "$sock" --namespace "$ns" run "${runflags[@]}" \
    --cgroup "$cg/smoke-probe" --device migdra.dev/smoke-cap=cap migdra.dev/e2e/gpu-probe:e2e smoke-probe)
  echo "$out"
  python3 -c '
import json, sys
got = json.load(sys.stdin)
assert {"path": "/dev/nvidia-caps/nvidia-cap21", "type": "c", "major": 1, "minor": 3} in got["devices"], got["devices"]
assert got["env"] == {"NVIDIA_VISIBLE_DEVICES": "void", "MIGDRA_SMOKE": "cap"}, got["env"]
assert got["libraries"]["libnvidia-ml.so.1"]["dlopen"] is None, got["libraries"]
assert got["nvidia_smi"] is None, got["nvidia_smi"]
' <<<"$out" || { log "gpu-probe did not report what the container got"; exit 1; }
fi

log "stopping containerd"
kill -TERM "$(cat "$run/containerd.pid")"
log "ok"
