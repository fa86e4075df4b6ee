package main

import (
	"fmt"
	"strings"
	"testing"

	oci "github.com/opencontainers/runtime-spec/specs-go"
	"tags.cncf.io/container-device-interface/pkg/cdi"
)

// The shape migdra's kubelet plugin writes: one spec per claim with the
// device's nodes and its own UUID variable, and one node-wide spec whose
// device "files" carries the driver's mounts, hooks and env. Every prepared
// device names both.
const driverSpec = `{
  "cdiVersion": "0.6.0",
  "kind": "gpu.migdra.dev/driver",
  "devices": [{
    "name": "files",
    "containerEdits": {
      "env": ["NVIDIA_CTK_LIBCUDA_DIR=/usr/lib/x86_64-linux-gnu", "NVIDIA_VISIBLE_DEVICES=void"],
      "mounts": [
        {"hostPath": "/driver/usr/lib/x86_64-linux-gnu/libcuda.so.580.82.07", "containerPath": "/usr/lib/x86_64-linux-gnu/libcuda.so.580.82.07", "options": ["ro", "nosuid", "nodev", "rbind", "rprivate"]},
        {"hostPath": "/driver/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.580.82.07", "containerPath": "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.580.82.07", "options": ["ro", "nosuid", "nodev", "rbind", "rprivate"]}
      ],
      "hooks": [
        {"hookName": "createContainer", "path": "/usr/bin/nvidia-cdi-hook", "args": ["nvidia-cdi-hook", "create-symlinks", "--link", "libcuda.so.580.82.07::/usr/lib/x86_64-linux-gnu/libcuda.so.1"], "env": ["NVIDIA_CTK_DEBUG=false"]},
        {"hookName": "createContainer", "path": "/usr/bin/nvidia-cdi-hook", "args": ["nvidia-cdi-hook", "update-ldcache", "--folder", "/usr/lib/x86_64-linux-gnu"], "env": ["NVIDIA_CTK_DEBUG=false"]}
      ]
    }
  }]
}`

// claimSpec is one claim's spec with one device on GPU minor gpu whose
// capability node has minor capMinor.
func claimSpec(uid, device string, gpu, capMinor int, uuid string) string {
	variable := "MIGDRA_DEVICE_UUID_" + strings.ToUpper(strings.ReplaceAll(device, "-", "_"))
	return fmt.Sprintf(`{
  "cdiVersion": "0.6.0",
  "kind": "gpu.migdra.dev/claim",
  "devices": [{
    "name": "%[1]s-%[2]s",
    "containerEdits": {
      "env": ["%[3]s=%[4]s"],
      "deviceNodes": [
        {"path": "/dev/nvidia%[5]d", "type": "c", "major": 195, "minor": %[5]d, "fileMode": 438},
        {"path": "/dev/nvidiactl", "type": "c", "major": 195, "minor": 255, "fileMode": 438},
        {"path": "/dev/nvidia-caps/nvidia-cap%[6]d", "type": "c", "major": 508, "minor": %[6]d}
      ]
    }
  }]
}`, uid, device, variable, uuid, gpu, capMinor)
}

const driverDevice = "gpu.migdra.dev/driver=files"

// A container with devices of two claims names the node-wide driver device
// twice: it gets both devices' nodes and variables, and the driver's mounts,
// hooks and NVIDIA_VISIBLE_DEVICES=void once.
func TestCDITwoClaimsShareTheNodeWideDriverDevice(t *testing.T) {
	e := newEnv(t, false)
	sbID, sb := e.runSandbox("default", "pair", "uid-pair")
	e.writeSpec("gpu.migdra.dev-driver.json", driverSpec)
	e.writeSpec("gpu.migdra.dev-claim_uid-a.json", claimSpec("uid-a", "gpu-0-mig-1g10gb-0", 0, 21, "MIG-aaaa"))
	e.writeSpec("gpu.migdra.dev-claim_uid-b.json", claimSpec("uid-b", "gpu-1-mig-2g20gb-2", 1, 147, "MIG-bbbb"))
	a := "gpu.migdra.dev/claim=uid-a-gpu-0-mig-1g10gb-0"
	b := "gpu.migdra.dev/claim=uid-b-gpu-1-mig-2g20gb-2"
	cfg := containerConfig(sb, "main", []string{"sleep"}, []string{"3600"}, a, driverDevice, b, driverDevice)
	id, err := e.rt.CreateContainer(ctxT(t), sbID, cfg, sb)
	if err != nil {
		t.Fatalf("CreateContainer: %v", err)
	}
	r := e.record("default", "pair", "main", id)
	if len(r.CDIDevices) != 4 {
		t.Fatalf("cdiDevices = %v: the kubelet's list is recorded as given", r.CDIDevices)
	}
	if want := []string{a, driverDevice, b}; !equal(r.InjectedCDIDevices, want) {
		t.Fatalf("injectedCDIDevices = %v, want %v", r.InjectedCDIDevices, want)
	}
	paths := map[string]int{}
	for _, d := range r.DeviceNodes {
		paths[d.Path]++
	}
	for _, p := range []string{"/dev/nvidia0", "/dev/nvidia1", "/dev/nvidiactl", "/dev/nvidia-caps/nvidia-cap21", "/dev/nvidia-caps/nvidia-cap147"} {
		if paths[p] != 1 {
			t.Fatalf("device node %s appears %d times in %+v", p, paths[p], r.DeviceNodes)
		}
	}
	for _, want := range []string{"MIGDRA_DEVICE_UUID_GPU_0_MIG_1G10GB_0=MIG-aaaa", "MIGDRA_DEVICE_UUID_GPU_1_MIG_2G20GB_2=MIG-bbbb", "NVIDIA_VISIBLE_DEVICES=void", "POD_ENV=from-pod"} {
		if !contains(r.Env, want) {
			t.Fatalf("env %v lacks %q", r.Env, want)
		}
	}
	visible := 0
	for _, kv := range r.Env {
		if strings.HasPrefix(kv, "NVIDIA_VISIBLE_DEVICES=") {
			visible++
		}
	}
	if visible != 1 {
		t.Fatalf("NVIDIA_VISIBLE_DEVICES set %d times: %v", visible, r.Env)
	}
	if len(r.Mounts) != 2 {
		t.Fatalf("mounts = %+v, want the two driver libraries once", r.Mounts)
	}
	for _, m := range r.Mounts {
		if !strings.HasPrefix(m.Source, "/driver/usr/lib/x86_64-linux-gnu/") || m.Destination != strings.TrimPrefix(m.Source, "/driver") || !contains(m.Options, "ro") || !contains(m.Options, "rbind") {
			t.Fatalf("mount %+v is not a read-only bind of the driver file at its path in the root", m)
		}
	}
	if len(r.Hooks) != 2 {
		t.Fatalf("hooks = %+v, want create-symlinks and update-ldcache once", r.Hooks)
	}
	for i, sub := range []string{"create-symlinks", "update-ldcache"} {
		h := r.Hooks[i]
		if h.Stage != "createContainer" || h.Path != "/usr/bin/nvidia-cdi-hook" || len(h.Args) < 2 || h.Args[0] != "nvidia-cdi-hook" || h.Args[1] != sub {
			t.Fatalf("hook %d = %+v, want nvidia-cdi-hook %s at createContainer", i, h, sub)
		}
	}
	if !contains(r.Hooks[0].Args, "libcuda.so.580.82.07::/usr/lib/x86_64-linux-gnu/libcuda.so.1") {
		t.Fatalf("create-symlinks args = %v", r.Hooks[0].Args)
	}
}

// What the CDI library itself does with a device named twice: mounts, device
// nodes and env are keyed (a second copy replaces the first), hooks are
// appended. So the de-duplication of names before injection (containerd's,
// modelled by the fake runtime) is what keeps the hooks single.
func TestCDILibraryKeepsMountsSingleButRepeatsHooksOfARepeatedDevice(t *testing.T) {
	dir := t.TempDir()
	e := &env{t: t, cdiDir: dir}
	e.writeSpec("gpu.migdra.dev-driver.json", driverSpec)
	cache, err := cdi.NewCache(cdi.WithSpecDirs(dir), cdi.WithAutoRefresh(false))
	if err != nil {
		t.Fatal(err)
	}
	spec := &oci.Spec{Process: &oci.Process{}, Linux: &oci.Linux{}}
	if _, err := cache.InjectDevices(spec, driverDevice, driverDevice); err != nil {
		t.Fatalf("InjectDevices: %v", err)
	}
	if len(spec.Mounts) != 2 {
		t.Fatalf("mounts = %+v: a repeated mount destination should be replaced", spec.Mounts)
	}
	visible := 0
	for _, kv := range spec.Process.Env {
		if strings.HasPrefix(kv, "NVIDIA_VISIBLE_DEVICES=") {
			visible++
		}
	}
	if visible != 1 {
		t.Fatalf("env = %v: a repeated variable should be replaced", spec.Process.Env)
	}
	if spec.Hooks == nil || len(spec.Hooks.CreateContainer) != 4 {
		t.Fatalf("hooks = %+v: the library appends a repeated device's hooks", spec.Hooks)
	}
}
