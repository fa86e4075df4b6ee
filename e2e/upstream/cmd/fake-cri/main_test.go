package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	internalapi "k8s.io/cri-api/pkg/apis"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
	crierrors "k8s.io/cri-api/pkg/errors"
	cri "k8s.io/cri-client/pkg"
)

// The test binary doubles as the fake-cri binary for TestSignalShutdown.
const runMainEnv = "FAKE_CRI_TEST_RUN_MAIN"

func TestMain(m *testing.M) {
	if os.Getenv(runMainEnv) != "" {
		os.Args = append([]string{"fake-cri"}, strings.Split(os.Getenv(runMainEnv), "\n")...)
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// ---- harness ----

type env struct {
	t         *testing.T
	socket    string
	cdiDir    string
	recordDir string
	logRoot   string
	rt        internalapi.RuntimeService
	img       internalapi.ImageManagerService
	conn      *grpc.ClientConn // raw client, for calls the cri-client hides
}

// newEnv starts the server in-process on a real unix socket and connects the
// kubelet's CRI client to it.
func newEnv(t *testing.T, useStreaming bool) *env {
	t.Helper()
	dir := t.TempDir()
	e := &env{
		t:         t,
		socket:    filepath.Join(dir, "cri.sock"),
		cdiDir:    filepath.Join(dir, "cdi"),
		recordDir: filepath.Join(dir, "records"),
		logRoot:   filepath.Join(dir, "pods"),
	}
	if err := os.MkdirAll(e.cdiDir, 0o755); err != nil {
		t.Fatal(err)
	}
	cfg := config{
		listen:      e.socket,
		cdiSpecDirs: []string{filepath.Join(dir, "no-such-dir"), e.cdiDir},
		recordDir:   e.recordDir,
		imageFsPath: filepath.Join(dir, "imagefs"),
		verbose:     testing.Verbose(),
	}
	ctx, cancel := context.WithCancel(context.Background())
	ready := make(chan struct{})
	done := make(chan error, 1)
	go func() { done <- run(ctx, cfg, ready) }()
	select {
	case <-ready:
	case err := <-done:
		cancel()
		t.Fatalf("server exited early: %v", err)
	case <-time.After(10 * time.Second):
		cancel()
		t.Fatal("server did not become ready")
	}
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("server: %v", err)
			}
		case <-time.After(15 * time.Second):
			t.Error("server did not stop")
		}
		if _, err := os.Stat(e.socket); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("socket %s still present after shutdown (err=%v)", e.socket, err)
		}
	})

	bctx, bcancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer bcancel()
	endpoint := "unix://" + e.socket
	rt, err := cri.NewRemoteRuntimeServiceBuilder().WithEndpoint(endpoint).
		WithConnectionTimeout(10 * time.Second).WithUseStreaming(useStreaming).Build(bctx)
	if err != nil {
		t.Fatalf("runtime client: %v", err)
	}
	img, err := cri.NewRemoteImageServiceBuilder().WithEndpoint(endpoint).
		WithConnectionTimeout(10 * time.Second).WithUseStreaming(useStreaming).Build(bctx)
	if err != nil {
		t.Fatalf("image client: %v", err)
	}
	conn, err := grpc.NewClient("unix://"+e.socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	e.rt, e.img, e.conn = rt, img, conn
	t.Cleanup(func() {
		_ = rt.Close(context.Background())
		_ = conn.Close()
	})
	return e
}

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

const podUIDLabel = "io.kubernetes.pod.uid"

func (e *env) sandboxConfig(ns, name, uid string, hostNetwork bool) *runtimeapi.PodSandboxConfig {
	mode := runtimeapi.NamespaceMode_POD
	if hostNetwork {
		mode = runtimeapi.NamespaceMode_NODE
	}
	return &runtimeapi.PodSandboxConfig{
		Metadata:     &runtimeapi.PodSandboxMetadata{Name: name, Namespace: ns, Uid: uid, Attempt: 0},
		Labels:       map[string]string{podUIDLabel: uid, "io.kubernetes.pod.name": name, "io.kubernetes.pod.namespace": ns},
		LogDirectory: filepath.Join(e.logRoot, ns+"_"+name+"_"+uid),
		Linux: &runtimeapi.LinuxPodSandboxConfig{SecurityContext: &runtimeapi.LinuxSandboxSecurityContext{
			NamespaceOptions: &runtimeapi.NamespaceOption{Network: mode, Pid: runtimeapi.NamespaceMode_CONTAINER, Ipc: runtimeapi.NamespaceMode_POD},
		}},
	}
}

func (e *env) runSandbox(ns, name, uid string) (string, *runtimeapi.PodSandboxConfig) {
	e.t.Helper()
	cfg := e.sandboxConfig(ns, name, uid, false)
	id, err := e.rt.RunPodSandbox(ctxT(e.t), cfg, "")
	if err != nil {
		e.t.Fatalf("RunPodSandbox: %v", err)
	}
	return id, cfg
}

func containerConfig(sb *runtimeapi.PodSandboxConfig, name string, command, args []string, cdi ...string) *runtimeapi.ContainerConfig {
	c := &runtimeapi.ContainerConfig{
		Metadata: &runtimeapi.ContainerMetadata{Name: name},
		Image:    &runtimeapi.ImageSpec{Image: "registry.example/busybox:1.36"},
		Command:  command,
		Args:     args,
		Envs: []*runtimeapi.KeyValue{
			{Key: "POD_ENV", Value: []byte("from-pod")},
		},
		Labels:  map[string]string{podUIDLabel: sb.Metadata.Uid, "io.kubernetes.container.name": name},
		LogPath: name + "/0.log",
	}
	for _, d := range cdi {
		c.CDIDevices = append(c.CDIDevices, &runtimeapi.CDIDevice{Name: d})
	}
	return c
}

func (e *env) createAndStart(sbID string, sb *runtimeapi.PodSandboxConfig, cfg *runtimeapi.ContainerConfig) string {
	e.t.Helper()
	id, err := e.rt.CreateContainer(ctxT(e.t), sbID, cfg, sb)
	if err != nil {
		e.t.Fatalf("CreateContainer: %v", err)
	}
	if err := e.rt.StartContainer(ctxT(e.t), id); err != nil {
		e.t.Fatalf("StartContainer: %v", err)
	}
	return id
}

func (e *env) status(id string) *runtimeapi.ContainerStatus {
	e.t.Helper()
	resp, err := e.rt.ContainerStatus(ctxT(e.t), id, false)
	if err != nil {
		e.t.Fatalf("ContainerStatus(%s): %v", id, err)
	}
	return resp.GetStatus()
}

// waitExited polls ContainerStatus like the kubelet's PLEG does.
func (e *env) waitExited(id string, timeout time.Duration) *runtimeapi.ContainerStatus {
	e.t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		st := e.status(id)
		if st.State == runtimeapi.ContainerState_CONTAINER_EXITED {
			return st
		}
		if time.Now().After(deadline) {
			e.t.Fatalf("container %s still %s after %v", id, st.State, timeout)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func (e *env) record(ns, pod, ctr, id string) *containerRecord {
	e.t.Helper()
	path := filepath.Join(e.recordDir, fmt.Sprintf("%s_%s_%s_%s.json", ns, pod, ctr, id))
	data, err := os.ReadFile(path)
	if err != nil {
		e.t.Fatalf("reading record: %v", err)
	}
	var r containerRecord
	if err := json.Unmarshal(data, &r); err != nil {
		e.t.Fatalf("decoding record %s: %v", path, err)
	}
	return &r
}

func (e *env) writeSpec(file, content string) {
	e.t.Helper()
	if err := os.WriteFile(filepath.Join(e.cdiDir, file), []byte(content), 0o644); err != nil {
		e.t.Fatal(err)
	}
}

func eventNames(r *containerRecord) []string {
	var out []string
	for _, ev := range r.Events {
		out = append(out, ev.Event)
	}
	return out
}

// ---- tests ----

func TestRuntimeConfigStatusVersion(t *testing.T) {
	e := newEnv(t, false)
	ctx := ctxT(t)

	rc, err := e.rt.RuntimeConfig(ctx)
	if err != nil {
		t.Fatalf("RuntimeConfig: %v", err)
	}
	if got := rc.GetLinux().GetCgroupDriver(); got != runtimeapi.CgroupDriver_CGROUPFS || rc.GetLinux() == nil {
		t.Fatalf("cgroup driver = %v (linux %v), want CGROUPFS", got, rc.GetLinux())
	}

	st, err := e.rt.Status(ctx, false)
	if err != nil {
		t.Fatalf("Status: %v", err)
	}
	ready := map[string]bool{}
	for _, c := range st.GetStatus().GetConditions() {
		ready[c.Type] = c.Status
	}
	if !ready[runtimeapi.RuntimeReady] || !ready[runtimeapi.NetworkReady] {
		t.Fatalf("conditions = %v, want RuntimeReady and NetworkReady true", st.GetStatus().GetConditions())
	}

	v, err := e.rt.Version(ctx, "v1")
	if err != nil {
		t.Fatalf("Version: %v", err)
	}
	if v.RuntimeName != "migdra-fake-cri" || v.RuntimeApiVersion != "v1" || !regexp.MustCompile(`^\d+\.\d+\.\d+$`).MatchString(v.RuntimeVersion) {
		t.Fatalf("version = %+v", v)
	}

	if err := e.rt.UpdateRuntimeConfig(ctx, &runtimeapi.RuntimeConfig{NetworkConfig: &runtimeapi.NetworkConfig{PodCidr: "10.88.0.0/16"}}); err != nil {
		t.Fatalf("UpdateRuntimeConfig: %v", err)
	}
	if _, err := e.rt.ListMetricDescriptors(ctx); err != nil {
		t.Fatalf("ListMetricDescriptors: %v", err)
	}
	if _, err := e.rt.ListPodSandboxMetrics(ctx); err != nil {
		t.Fatalf("ListPodSandboxMetrics: %v", err)
	}

	// GetContainerEvents is Unimplemented (the evented PLEG falls back).
	raw := runtimeapi.NewRuntimeServiceClient(e.conn)
	stream, err := raw.GetContainerEvents(ctx, &runtimeapi.GetEventsRequest{})
	if err == nil {
		_, err = stream.Recv()
	}
	if status.Code(err) != codes.Unimplemented {
		t.Fatalf("GetContainerEvents: %v, want Unimplemented", err)
	}
	if _, err := raw.Exec(ctx, &runtimeapi.ExecRequest{ContainerId: "x", Cmd: []string{"sh"}}); status.Code(err) != codes.Unimplemented {
		t.Fatalf("Exec: %v, want Unimplemented", err)
	}
}

func TestImages(t *testing.T) {
	e := newEnv(t, false)
	ctx := ctxT(t)
	spec := &runtimeapi.ImageSpec{Image: "no.such.registry.invalid/anything/at-all:v0.0.1"}
	if st, err := e.img.ImageStatus(ctx, spec, false); err != nil || st.GetImage() != nil {
		t.Fatalf("ImageStatus before pull = %v, %v; want nil image", st, err)
	}
	ref, err := e.img.PullImage(ctx, spec, nil, nil)
	if err != nil || ref == "" {
		t.Fatalf("PullImage = %q, %v", ref, err)
	}
	st, err := e.img.ImageStatus(ctx, spec, false)
	if err != nil || st.GetImage() == nil {
		t.Fatalf("ImageStatus after pull = %v, %v", st, err)
	}
	imgs, err := e.img.ListImages(ctx, nil)
	if err != nil {
		t.Fatalf("ListImages: %v", err)
	}
	found := false
	for _, im := range imgs {
		for _, tag := range im.RepoTags {
			found = found || tag == spec.Image
		}
	}
	if !found {
		t.Fatalf("pulled image not listed: %v", imgs)
	}
	fsInfo, err := e.img.ImageFsInfo(ctx)
	if err != nil {
		t.Fatalf("ImageFsInfo: %v", err)
	}
	if len(fsInfo.ImageFilesystems) != 1 || len(fsInfo.ContainerFilesystems) != 1 {
		t.Fatalf("ImageFsInfo = %v", fsInfo)
	}
	ifs := fsInfo.ImageFilesystems[0]
	if ifs.GetUsedBytes() == nil || ifs.GetUsedBytes().GetValue() == 0 || ifs.GetInodesUsed() == nil ||
		ifs.GetFsId().GetMountpoint() == "" || ifs.Timestamp == 0 {
		t.Fatalf("image filesystem = %v", ifs)
	}
	if fsInfo.ContainerFilesystems[0].GetFsId().GetMountpoint() != ifs.GetFsId().GetMountpoint() {
		t.Fatalf("container fs %v differs from image fs %v", fsInfo.ContainerFilesystems[0], ifs)
	}
	for i := 0; i < 2; i++ { // idempotent
		if err := e.img.RemoveImage(ctx, spec); err != nil {
			t.Fatalf("RemoveImage: %v", err)
		}
	}
}

func TestSandboxLifecycle(t *testing.T) {
	e := newEnv(t, false)
	ctx := ctxT(t)
	id, _ := e.runSandbox("ns1", "pod-a", "uid-a")
	hostCfg := e.sandboxConfig("ns1", "pod-host", "uid-host", true)
	hostID, err := e.rt.RunPodSandbox(ctx, hostCfg, "")
	if err != nil {
		t.Fatal(err)
	}

	st, err := e.rt.PodSandboxStatus(ctx, id, false)
	if err != nil {
		t.Fatalf("PodSandboxStatus: %v", err)
	}
	s := st.GetStatus()
	if s.State != runtimeapi.PodSandboxState_SANDBOX_READY {
		t.Fatalf("state = %v", s.State)
	}
	if ip := net.ParseIP(s.GetNetwork().GetIp()); ip == nil || !strings.HasPrefix(ip.String(), "10.88.") {
		t.Fatalf("sandbox IP = %q, want 10.88.x.y", s.GetNetwork().GetIp())
	}
	if s.GetLinux().GetNamespaces().GetOptions().GetNetwork() != runtimeapi.NamespaceMode_POD {
		t.Fatalf("namespace options not reported: %v", s.GetLinux())
	}
	hst, err := e.rt.PodSandboxStatus(ctx, hostID, false)
	if err != nil || hst.GetStatus().GetNetwork().GetIp() != "" {
		t.Fatalf("host-network sandbox status = %v, %v; want no IP", hst, err)
	}

	list, err := e.rt.ListPodSandbox(ctx, &runtimeapi.PodSandboxFilter{LabelSelector: map[string]string{podUIDLabel: "uid-a"}})
	if err != nil || len(list) != 1 || list[0].Id != id {
		t.Fatalf("ListPodSandbox(label) = %v, %v", list, err)
	}

	if err := e.rt.StopPodSandbox(ctx, id); err != nil {
		t.Fatalf("StopPodSandbox: %v", err)
	}
	if err := e.rt.StopPodSandbox(ctx, id); err != nil {
		t.Fatalf("second StopPodSandbox: %v", err)
	}
	ready, err := e.rt.ListPodSandbox(ctx, &runtimeapi.PodSandboxFilter{State: &runtimeapi.PodSandboxStateValue{State: runtimeapi.PodSandboxState_SANDBOX_READY}})
	if err != nil || len(ready) != 1 || ready[0].Id != hostID {
		t.Fatalf("ready sandboxes = %v, %v", ready, err)
	}
	for i := 0; i < 2; i++ {
		if err := e.rt.RemovePodSandbox(ctx, id); err != nil {
			t.Fatalf("RemovePodSandbox: %v", err)
		}
	}
	if _, err := e.rt.PodSandboxStatus(ctx, id, false); !crierrors.IsNotFound(err) {
		t.Fatalf("PodSandboxStatus of removed sandbox: %v, want NotFound", err)
	}
	if err := e.rt.StopPodSandbox(ctx, id); !crierrors.IsNotFound(err) {
		t.Fatalf("StopPodSandbox of removed sandbox: %v, want NotFound", err)
	}
}

const validSpec = `{
  "cdiVersion": "0.6.0",
  "kind": "k8s.migdra.dev/mig",
  "containerEdits": {"env": ["MIGDRA_SPEC_WIDE=yes"]},
  "devices": [
    {
      "name": "claim-1111-gpu-0-mig-0",
      "containerEdits": {
        "env": ["NVIDIA_VISIBLE_DEVICES=MIG-aaaa", "MIGDRA_DEVICE=gpu-0-mig-0"],
        "deviceNodes": [
          {"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0, "fileMode": 438},
          {"path": "/dev/nvidia-caps/nvidia-cap30", "type": "c", "major": 234, "minor": 30}
        ],
        "mounts": [
          {"hostPath": "/var/lib/migdra/claim-1111", "containerPath": "/run/migdra", "options": ["ro", "bind"]}
        ]
      }
    },
    {
      "name": "claim-1111-gpu-1-mig-0",
      "containerEdits": {
        "env": ["MIGDRA_SECOND=1"],
        "deviceNodes": [{"path": "/dev/nvidia1", "type": "c", "major": 195, "minor": 1}]
      }
    }
  ]
}`

func TestCDIInjection(t *testing.T) {
	e := newEnv(t, false)
	ctx := ctxT(t)
	sbID, sb := e.runSandbox("gpu-test", "mig-pod", "uid-mig")
	// Written after the server started: the registry must be refreshed
	// before each resolution, as a per-claim spec is written just before.
	e.writeSpec("k8s.migdra.dev-mig_claim-1111.json", validSpec)

	cfg := containerConfig(sb, "ctr", []string{"sleep"}, []string{"3600"}, "k8s.migdra.dev/mig=claim-1111-gpu-0-mig-0")
	// A legacy annotation adds a second device (and a duplicate is ignored).
	cfg.Annotations = map[string]string{
		"cdi.k8s.io/test": "k8s.migdra.dev/mig=claim-1111-gpu-1-mig-0,k8s.migdra.dev/mig=claim-1111-gpu-0-mig-0",
	}
	id, err := e.rt.CreateContainer(ctx, sbID, cfg, sb)
	if err != nil {
		t.Fatalf("CreateContainer: %v", err)
	}
	r := e.record("gpu-test", "mig-pod", "ctr", id)
	if data, err := json.MarshalIndent(r, "", "  "); err == nil {
		t.Logf("record after CreateContainer:\n%s", data)
	}
	if r.PodNamespace != "gpu-test" || r.PodName != "mig-pod" || r.PodUID != "uid-mig" || r.ContainerName != "ctr" || r.ContainerID != id || r.SandboxID != sbID {
		t.Fatalf("record identity = %+v", r)
	}
	if r.State != "created" || r.ExitCode != nil || r.CreatedAt == "" {
		t.Fatalf("record state = %q exit %v created %q", r.State, r.ExitCode, r.CreatedAt)
	}
	if want := []string{"k8s.migdra.dev/mig=claim-1111-gpu-0-mig-0"}; !equal(r.CDIDevices, want) {
		t.Fatalf("cdiDevices = %v, want %v", r.CDIDevices, want)
	}
	if len(r.CDIAnnotationDevices) != 2 {
		t.Fatalf("cdiAnnotationDevices = %v", r.CDIAnnotationDevices)
	}
	if want := []string{"k8s.migdra.dev/mig=claim-1111-gpu-0-mig-0", "k8s.migdra.dev/mig=claim-1111-gpu-1-mig-0"}; !equal(r.InjectedCDIDevices, want) {
		t.Fatalf("injectedCDIDevices = %v, want %v", r.InjectedCDIDevices, want)
	}
	nodes := map[string]deviceNodeRecord{}
	for _, d := range r.DeviceNodes {
		nodes[d.Path] = d
	}
	if len(nodes) != 3 {
		t.Fatalf("device nodes = %+v", r.DeviceNodes)
	}
	n0 := nodes["/dev/nvidia0"]
	if n0.Type != "c" || n0.Major != 195 || n0.Minor != 0 || n0.FileMode == nil || *n0.FileMode != 0o666 {
		t.Fatalf("/dev/nvidia0 = %+v", n0)
	}
	if c := nodes["/dev/nvidia-caps/nvidia-cap30"]; c.Type != "c" || c.Major != 234 || c.Minor != 30 {
		t.Fatalf("cap node = %+v", c)
	}
	for _, want := range []string{"POD_ENV=from-pod", "NVIDIA_VISIBLE_DEVICES=MIG-aaaa", "MIGDRA_DEVICE=gpu-0-mig-0", "MIGDRA_SPEC_WIDE=yes", "MIGDRA_SECOND=1"} {
		if !contains(r.Env, want) {
			t.Fatalf("env %v lacks %q", r.Env, want)
		}
	}
	if len(r.Mounts) != 1 || r.Mounts[0].Destination != "/run/migdra" || r.Mounts[0].Source != "/var/lib/migdra/claim-1111" {
		t.Fatalf("mounts = %+v", r.Mounts)
	}
	if !equal(r.Command, []string{"sleep"}) || !equal(r.Args, []string{"3600"}) || r.Image != cfg.Image.Image {
		t.Fatalf("command/args/image = %v %v %q", r.Command, r.Args, r.Image)
	}

	// The status the kubelet reads.
	st := e.status(id)
	if st.State != runtimeapi.ContainerState_CONTAINER_CREATED || st.GetMetadata().GetName() != "ctr" || st.GetImage().GetImage() != cfg.Image.Image {
		t.Fatalf("status = %v", st)
	}
	wantLog := filepath.Join(sb.LogDirectory, "ctr/0.log")
	if st.LogPath != wantLog {
		t.Fatalf("log path = %q, want %q", st.LogPath, wantLog)
	}

	// Start: the log file appears (kubectl logs / rotation need it) and holds the env.
	if err := e.rt.StartContainer(ctx, id); err != nil {
		t.Fatalf("StartContainer: %v", err)
	}
	logData, err := os.ReadFile(wantLog)
	if err != nil {
		t.Fatalf("log file: %v", err)
	}
	criLine := regexp.MustCompile(`^\S+ stdout F NVIDIA_VISIBLE_DEVICES=MIG-aaaa$`)
	okLine := false
	for _, l := range strings.Split(strings.TrimSpace(string(logData)), "\n") {
		fields := strings.SplitN(l, " ", 4)
		if len(fields) != 4 || fields[1] != "stdout" || fields[2] != "F" {
			t.Fatalf("log line %q is not in CRI format", l)
		}
		if _, err := time.Parse(time.RFC3339Nano, fields[0]); err != nil {
			t.Fatalf("log line %q: %v", l, err)
		}
		okLine = okLine || criLine.MatchString(l)
	}
	if !okLine {
		t.Fatalf("log lacks the CDI env line:\n%s", logData)
	}
	if r := e.record("gpu-test", "mig-pod", "ctr", id); r.State != "running" || r.StartedAt == "" {
		t.Fatalf("record after start = %q %q", r.State, r.StartedAt)
	}
	if err := e.rt.ReopenContainerLog(ctx, id); err != nil {
		t.Fatalf("ReopenContainerLog: %v", err)
	}
}

func TestCDIUnresolvableDeviceFailsCreate(t *testing.T) {
	e := newEnv(t, false)
	ctx := ctxT(t)
	sbID, sb := e.runSandbox("gpu-test", "bad-pod", "uid-bad")
	e.writeSpec("k8s.migdra.dev-mig_claim-1111.json", validSpec)
	// An invalid spec must not break resolution of other vendors' devices
	// but its own devices are unresolvable.
	e.writeSpec("broken.yaml", "cdiVersion: 0.6.0\nkind: broken.example/gpu\ndevices: [ {name: \"x\", containerEdits: {deviceNodes: [ {path: 12} ]}\n")

	// Parses, but a device node has no path: the loader rejects the spec.
	e.writeSpec("invalid.json", `{"cdiVersion": "0.6.0", "kind": "invalid.example/gpu",
	  "devices": [{"name": "x", "containerEdits": {"deviceNodes": [{"type": "c", "major": 1, "minor": 1}]}}]}`)
	// A spec too new for the CDI library.
	e.writeSpec("future.json", `{"cdiVersion": "99.0.0", "kind": "future.example/gpu",
	  "devices": [{"name": "x", "containerEdits": {"env": ["A=1"]}}]}`)

	cases := map[string]string{
		"unknown device":       "k8s.migdra.dev/mig=claim-2222-gpu-0-mig-9",
		"unknown vendor":       "nope.example/gpu=0",
		"unparsable spec":      "broken.example/gpu=x",
		"invalid spec":         "invalid.example/gpu=x",
		"unsupported version":  "future.example/gpu=x",
		"not a qualified name": "claim-1111-gpu-0-mig-0",
	}
	for name, device := range cases {
		t.Run(name, func(t *testing.T) {
			cfg := containerConfig(sb, "ctr", nil, nil, "k8s.migdra.dev/mig=claim-1111-gpu-0-mig-0", device)
			_, err := e.rt.CreateContainer(ctx, sbID, cfg, sb)
			if err == nil {
				t.Fatal("CreateContainer succeeded")
			}
			msg := status.Convert(err).Message()
			if !strings.Contains(msg, "CDI device injection failed: unresolvable CDI devices "+device) {
				t.Fatalf("error %q does not name the device %q the way containerd does", msg, device)
			}
			if strings.Contains(msg, "claim-1111-gpu-0-mig-0,") {
				t.Fatalf("error %q names a resolvable device", msg)
			}
		})
	}
	cs, err := e.rt.ListContainers(ctx, nil)
	if err != nil || len(cs) != 0 {
		t.Fatalf("containers after failed creates = %v, %v", cs, err)
	}
	if files, _ := filepath.Glob(filepath.Join(e.recordDir, "*.json")); len(files) != 0 {
		t.Fatalf("records written for failed creates: %v", files)
	}
	// The valid device alone still works.
	if _, err := e.rt.CreateContainer(ctx, sbID, containerConfig(sb, "ok", nil, nil, "k8s.migdra.dev/mig=claim-1111-gpu-0-mig-0"), sb); err != nil {
		t.Fatalf("CreateContainer with a valid device next to a broken spec: %v", err)
	}
}

func TestSleepExitsZero(t *testing.T) {
	e := newEnv(t, false)
	sbID, sb := e.runSandbox("default", "sleeper", "uid-sleep")
	for name, cmd := range map[string][2][]string{
		"argv":  {{"sleep", "1"}, nil},
		"shell": {{"sh", "-c"}, {"sleep 1"}},
	} {
		t.Run(name, func(t *testing.T) {
			ctrName := "sleep-" + name
			id := e.createAndStart(sbID, sb, containerConfig(sb, ctrName, cmd[0], cmd[1]))
			if st := e.status(id); st.State != runtimeapi.ContainerState_CONTAINER_RUNNING || st.StartedAt == 0 {
				t.Fatalf("right after start: %v", st)
			}
			st := e.waitExited(id, 30*time.Second)
			if st.ExitCode != 0 || st.Reason != "Completed" || st.FinishedAt < st.StartedAt || st.StartedAt < st.CreatedAt {
				t.Fatalf("exited status = %v", st)
			}
			// Visible in a state-filtered list too (the PLEG relists).
			list, err := e.rt.ListContainers(ctxT(t), &runtimeapi.ContainerFilter{
				State:         &runtimeapi.ContainerStateValue{State: runtimeapi.ContainerState_CONTAINER_EXITED},
				LabelSelector: map[string]string{podUIDLabel: "uid-sleep", "io.kubernetes.container.name": ctrName},
			})
			if err != nil || len(list) != 1 || list[0].Id != id {
				t.Fatalf("ListContainers(EXITED) = %v, %v", list, err)
			}
			r := e.record("default", "sleeper", ctrName, id)
			if r.State != "exited" || r.ExitCode == nil || *r.ExitCode != 0 || r.Reason != "Completed" || r.ExitedBy != "process" || r.FinishedAt == "" {
				t.Fatalf("record = %+v", r)
			}
			if got := eventNames(r); !equal(got, []string{"created", "started", "exited"}) {
				t.Fatalf("events = %v", got)
			}
			// Stopping an exited container keeps its exit code.
			if err := e.rt.StopContainer(ctxT(t), id, 10); err != nil {
				t.Fatalf("StopContainer after exit: %v", err)
			}
			if st := e.status(id); st.ExitCode != 0 {
				t.Fatalf("exit code after stop = %d", st.ExitCode)
			}
		})
	}
}

func TestExitCode(t *testing.T) {
	e := newEnv(t, false)
	sbID, sb := e.runSandbox("default", "failer", "uid-fail")
	cases := []struct {
		name      string
		cmd, args []string
		code      int32
	}{
		{"exit3", []string{"sh", "-c", "exit 3"}, nil, 3},
		{"exit7", []string{"/bin/sh"}, []string{"-c", "sleep 0.2; exit 7"}, 7},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			id := e.createAndStart(sbID, sb, containerConfig(sb, c.name, c.cmd, c.args))
			st := e.waitExited(id, 30*time.Second)
			if st.ExitCode != c.code || st.Reason != "Error" || st.FinishedAt == 0 {
				t.Fatalf("status = %v", st)
			}
			r := e.record("default", "failer", c.name, id)
			if r.State != "exited" || r.ExitCode == nil || *r.ExitCode != c.code || r.Reason != "Error" || r.ExitedBy != "process" {
				t.Fatalf("record = %+v", r)
			}
		})
	}
}

func TestRunsUntilStopped(t *testing.T) {
	e := newEnv(t, false)
	ctx := ctxT(t)
	sbID, sb := e.runSandbox("default", "server", "uid-srv")
	idDefault := e.createAndStart(sbID, sb, containerConfig(sb, "entrypoint", nil, nil)) // image default entrypoint
	idCmd := e.createAndStart(sbID, sb, containerConfig(sb, "nginx", []string{"nginx", "-g", "daemon off;"}, nil))
	time.Sleep(1500 * time.Millisecond)
	for _, id := range []string{idDefault, idCmd} {
		if st := e.status(id); st.State != runtimeapi.ContainerState_CONTAINER_RUNNING {
			t.Fatalf("container %s is %v, want RUNNING", id, st.State)
		}
	}
	running, err := e.rt.ListContainers(ctx, &runtimeapi.ContainerFilter{
		PodSandboxId: sbID,
		State:        &runtimeapi.ContainerStateValue{State: runtimeapi.ContainerState_CONTAINER_RUNNING},
	})
	if err != nil || len(running) != 2 {
		t.Fatalf("running containers = %v, %v", running, err)
	}

	for i := 0; i < 2; i++ { // idempotent
		if err := e.rt.StopContainer(ctx, idCmd, 30); err != nil {
			t.Fatalf("StopContainer #%d: %v", i, err)
		}
	}
	st := e.status(idCmd)
	if st.State != runtimeapi.ContainerState_CONTAINER_EXITED || st.ExitCode != 137 || st.Reason != "Error" {
		t.Fatalf("stopped status = %v", st)
	}
	r := e.record("default", "server", "nginx", idCmd)
	if *r.ExitCode != 137 || r.ExitedBy != "StopContainer" {
		t.Fatalf("record = %+v", r)
	}
	if err := e.rt.StartContainer(ctx, idCmd); err == nil {
		t.Fatal("StartContainer of an exited container succeeded")
	}

	// Removal: idempotent, NotFound afterwards, record kept with removedAt.
	for i := 0; i < 2; i++ {
		if err := e.rt.RemoveContainer(ctx, idCmd); err != nil {
			t.Fatalf("RemoveContainer: %v", err)
		}
	}
	if _, err := e.rt.ContainerStatus(ctx, idCmd, false); !crierrors.IsNotFound(err) {
		t.Fatalf("ContainerStatus after removal: %v, want NotFound", err)
	}
	if err := e.rt.StopContainer(ctx, idCmd, 0); !crierrors.IsNotFound(err) {
		t.Fatalf("StopContainer after removal: %v, want NotFound", err)
	}
	if r := e.record("default", "server", "nginx", idCmd); r.RemovedAt == "" || eventNames(r)[len(r.Events)-1] != "removed" {
		t.Fatalf("record after removal = %+v", r)
	}

	// Stopping the sandbox kills what still runs.
	if err := e.rt.StopPodSandbox(ctx, sbID); err != nil {
		t.Fatal(err)
	}
	if st := e.status(idDefault); st.State != runtimeapi.ContainerState_CONTAINER_EXITED || st.ExitCode != 137 {
		t.Fatalf("after StopPodSandbox: %v", st)
	}
	if r := e.record("default", "server", "entrypoint", idDefault); r.ExitedBy != "StopPodSandbox" {
		t.Fatalf("record = %+v", r)
	}
	if err := e.rt.RemovePodSandbox(ctx, sbID); err != nil {
		t.Fatal(err)
	}
	if all, err := e.rt.ListContainers(ctx, nil); err != nil || len(all) != 0 {
		t.Fatalf("containers after RemovePodSandbox = %v, %v", all, err)
	}
}

func TestContainerNameReserved(t *testing.T) {
	e := newEnv(t, false)
	sbID, sb := e.runSandbox("default", "dup", "uid-dup")
	cfg := containerConfig(sb, "c", nil, nil)
	if _, err := e.rt.CreateContainer(ctxT(t), sbID, cfg, sb); err != nil {
		t.Fatal(err)
	}
	if _, err := e.rt.CreateContainer(ctxT(t), sbID, cfg, sb); err == nil || !strings.Contains(err.Error(), "is reserved") {
		t.Fatalf("second create with same name/attempt: %v", err)
	}
	cfg.Metadata.Attempt = 1
	if _, err := e.rt.CreateContainer(ctxT(t), sbID, cfg, sb); err != nil {
		t.Fatalf("create with next attempt: %v", err)
	}
	if _, err := e.rt.CreateContainer(ctxT(t), "no-such-sandbox", cfg, sb); !crierrors.IsNotFound(err) {
		t.Fatalf("create in unknown sandbox: %v, want NotFound", err)
	}
}

func TestStats(t *testing.T) {
	for _, streaming := range []bool{false, true} {
		t.Run(fmt.Sprintf("streaming=%v", streaming), func(t *testing.T) {
			e := newEnv(t, streaming)
			ctx := ctxT(t)
			sbID, sb := e.runSandbox("default", "stats", "uid-stats")
			id := e.createAndStart(sbID, sb, containerConfig(sb, "c", nil, nil))
			created, err := e.rt.CreateContainer(ctx, sbID, containerConfig(sb, "not-started", nil, nil), sb)
			if err != nil {
				t.Fatal(err)
			}

			cs, err := e.rt.ContainerStats(ctx, id)
			if err != nil || cs.GetAttributes().GetId() != id || cs.GetCpu() == nil || cs.GetMemory() == nil {
				t.Fatalf("ContainerStats = %v, %v", cs, err)
			}
			if _, err := e.rt.ContainerStats(ctx, "nope"); !crierrors.IsNotFound(err) {
				t.Fatalf("ContainerStats(unknown) = %v, want NotFound", err)
			}
			list, err := e.rt.ListContainerStats(ctx, &runtimeapi.ContainerStatsFilter{})
			if err != nil || len(list) != 1 || list[0].GetAttributes().GetId() != id {
				t.Fatalf("ListContainerStats = %v, %v (only the running container expected, not %s)", list, err, created)
			}
			ps, err := e.rt.PodSandboxStats(ctx, sbID)
			if err != nil || ps.GetLinux() == nil || len(ps.GetLinux().GetContainers()) != 1 {
				t.Fatalf("PodSandboxStats = %v, %v", ps, err)
			}
			pl, err := e.rt.ListPodSandboxStats(ctx, &runtimeapi.PodSandboxStatsFilter{})
			if err != nil || len(pl) != 1 {
				t.Fatalf("ListPodSandboxStats = %v, %v", pl, err)
			}
			// The list calls the kubelet's PLEG and stats provider make.
			cl, err := e.rt.ListContainers(ctx, &runtimeapi.ContainerFilter{})
			if err != nil || len(cl) != 2 {
				t.Fatalf("ListContainers = %v, %v", cl, err)
			}
			sl, err := e.rt.ListPodSandbox(ctx, &runtimeapi.PodSandboxFilter{})
			if err != nil || len(sl) != 1 {
				t.Fatalf("ListPodSandbox = %v, %v", sl, err)
			}
			if _, err := e.rt.ListPodSandboxMetrics(ctx); err != nil {
				t.Fatalf("ListPodSandboxMetrics: %v", err)
			}
			if imgs, err := e.img.ListImages(ctx, nil); err != nil {
				t.Fatalf("ListImages = %v, %v", imgs, err)
			}
		})
	}
}

func TestSignalShutdown(t *testing.T) {
	dir := t.TempDir()
	sock := filepath.Join(dir, "run", "cri.sock")
	if err := os.MkdirAll(filepath.Dir(sock), 0o755); err != nil {
		t.Fatal(err)
	}
	// Leave a stale socket behind, as a crashed runtime would.
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	l.(*net.UnixListener).SetUnlinkOnClose(false)
	l.Close()

	for _, sig := range []syscall.Signal{syscall.SIGTERM, syscall.SIGINT} {
		t.Run(sig.String(), func(t *testing.T) {
			cmd := exec.Command(os.Args[0], "-test.run=^$")
			cmd.Env = append(os.Environ(), runMainEnv+"="+strings.Join([]string{
				"--listen", sock, "--cdi-spec-dir", filepath.Join(dir, "cdi"),
				"--record-dir", filepath.Join(dir, "records"), "--image-fs-path", filepath.Join(dir, "imagefs"),
			}, "\n"))
			out := &strings.Builder{}
			cmd.Stdout, cmd.Stderr = out, out
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			exited := make(chan error, 1)
			go func() { exited <- cmd.Wait() }()

			deadline := time.Now().Add(20 * time.Second)
			for {
				c, err := net.Dial("unix", sock)
				if err == nil {
					c.Close()
					break
				}
				if time.Now().After(deadline) {
					_ = cmd.Process.Kill()
					t.Fatalf("socket never accepted connections: %v\n%s", err, out)
				}
				time.Sleep(50 * time.Millisecond)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			rt, err := cri.NewRemoteRuntimeServiceBuilder().WithEndpoint("unix://" + sock).WithConnectionTimeout(10 * time.Second).Build(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if rc, err := rt.RuntimeConfig(ctx); err != nil || rc.GetLinux().GetCgroupDriver() != runtimeapi.CgroupDriver_CGROUPFS {
				t.Fatalf("RuntimeConfig = %v, %v", rc, err)
			}
			_ = rt.Close(ctx)

			if err := cmd.Process.Signal(sig); err != nil {
				t.Fatal(err)
			}
			select {
			case err := <-exited:
				if err != nil {
					t.Fatalf("exit after %v: %v\n%s", sig, err, out)
				}
			case <-time.After(20 * time.Second):
				_ = cmd.Process.Kill()
				t.Fatalf("no exit after %v\n%s", sig, out)
			}
			if _, err := os.Lstat(sock); !errors.Is(err, os.ErrNotExist) {
				t.Fatalf("socket not removed after %v: %v", sig, err)
			}
		})
	}
}

func TestFlags(t *testing.T) {
	var sink strings.Builder
	cfg, err := parseFlags([]string{"--listen", "unix:///run/x.sock", "-v", "--record-dir", "/r"}, &sink)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.listen != "/run/x.sock" || !cfg.verbose || cfg.recordDir != "/r" || !equal(cfg.cdiSpecDirs, []string{"/etc/cdi", "/var/run/cdi"}) {
		t.Fatalf("cfg = %+v", cfg)
	}
	cfg, err = parseFlags([]string{"--listen=/s", "--cdi-spec-dir", "/a", "--cdi-spec-dir=/b"}, &sink)
	if err != nil || !equal(cfg.cdiSpecDirs, []string{"/a", "/b"}) {
		t.Fatalf("cfg = %+v, %v", cfg, err)
	}
	if _, err := parseFlags(nil, &sink); err == nil {
		t.Fatal("missing --listen accepted")
	}
}

func TestModelProcess(t *testing.T) {
	forever := behaviour{}
	cases := []struct {
		cmd, args []string
		want      behaviour
	}{
		{nil, nil, forever},
		{[]string{"nginx"}, nil, forever},
		{[]string{"sleep", "5"}, nil, behaviour{exits: true, after: 5 * time.Second}},
		{[]string{"sleep"}, []string{"0.5"}, behaviour{exits: true, after: 500 * time.Millisecond}},
		{[]string{"/bin/sleep", "2m"}, nil, behaviour{exits: true, after: 2 * time.Minute}},
		{[]string{"sleep", "infinity"}, nil, forever},
		{[]string{"sh", "-c", "sleep 5"}, nil, behaviour{exits: true, after: 5 * time.Second}},
		{[]string{"sh"}, []string{"-c", "sleep 5"}, behaviour{exits: true, after: 5 * time.Second}},
		{[]string{"/bin/bash", "-c", "exit 3"}, nil, behaviour{exits: true, exitCode: 3}},
		{[]string{"exit", "4"}, nil, behaviour{exits: true, exitCode: 4}},
		{[]string{"sh", "-c", "exit"}, nil, behaviour{exits: true}},
		{[]string{"sh", "-c", "sleep 1; exit 2"}, nil, behaviour{exits: true, after: time.Second, exitCode: 2}},
		{[]string{"sh", "-c", "sleep 1 && sleep 2"}, nil, behaviour{exits: true, after: 3 * time.Second}},
		{[]string{"sh", "-c", "false && sleep 9"}, nil, behaviour{exits: true, exitCode: 1}},
		{[]string{"sh", "-c", "exit 300"}, nil, behaviour{exits: true, exitCode: 44}},
		{[]string{"busybox", "sleep", "1"}, nil, behaviour{exits: true, after: time.Second}},
		{[]string{"true"}, nil, behaviour{exits: true}},
		{[]string{"sh", "-c", "nvidia-smi -L; sleep 5"}, nil, forever},
		{[]string{"sh", "-c", "sleep 5 &"}, nil, forever},
		{[]string{"sleep", "abc"}, nil, forever},
		{[]string{"sleep", "1", "2"}, nil, forever},
	}
	for _, c := range cases {
		if got := modelProcess(c.cmd, c.args); got != c.want {
			t.Errorf("modelProcess(%q, %q) = %+v, want %+v", c.cmd, c.args, got, c.want)
		}
	}
}

func TestRecordFileName(t *testing.T) {
	r := &containerRecord{PodNamespace: "ns", PodName: "a/b", ContainerName: "c_d", ContainerID: "0123"}
	if got := recordFileName(r); got != "ns_a-b_c-d_0123.json" {
		t.Fatalf("name = %q", got)
	}
}

func equal(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}
