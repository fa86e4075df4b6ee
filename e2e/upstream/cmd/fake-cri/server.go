package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"log"
	"net"
	"os"
	"path/filepath"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
	apitest "k8s.io/cri-api/pkg/apis/testing"
	"k8s.io/cri-client/pkg/fake"
)

const (
	runtimeName    = "migdra-fake-cri"
	runtimeVersion = "0.1.0" // must parse as a semantic version (the kubelet does)
	apiVersion     = "v1"
	fakeImageSize  = 1 << 20
	killedExitCode = 137
)

type config struct {
	listen      string
	cdiSpecDirs []string
	recordDir   string
	imageFsPath string
	verbose     bool
}

// containerExtra is what the fake keeps per container beyond the CRI status
// stored in the embedded FakeRuntimeService.
type containerExtra struct {
	behaviour behaviour
	timer     *time.Timer
	record    *containerRecord
}

// server serves the CRI. It embeds cri-client's fake gRPC server (which
// forwards every RPC to cri-api's FakeRuntimeService / FakeImageService) and
// overrides the RPCs that must behave like a real runtime. All state lives
// in the FakeRuntimeService maps and is guarded by its mutex (rt.Lock), so
// the RPCs inherited from the fake (ListContainers, ContainerStatus,
// ListPodSandbox, PodSandboxStatus, the Stream* list calls, ...) always see
// the transitions made here.
type server struct {
	*fake.RemoteRuntime
	rt  *apitest.FakeRuntimeService
	img *apitest.FakeImageService
	cfg config
	cdi *cdiInjector

	// Guarded by rt's mutex.
	extra   map[string]*containerExtra
	nextIP  uint32
	closing bool

	imageFsID *runtimeapi.FilesystemIdentifier
}

func newServer(cfg config) (*server, error) {
	inj, err := newCDIInjector(cfg.cdiSpecDirs)
	if err != nil {
		return nil, fmt.Errorf("CDI cache: %w", err)
	}
	rr := fake.NewFakeRemoteRuntime()
	s := &server{
		RemoteRuntime: rr,
		rt:            rr.RuntimeService,
		img:           rr.ImageService,
		cfg:           cfg,
		cdi:           inj,
		extra:         map[string]*containerExtra{},
		nextIP:        2,
	}
	s.rt.FakeStatus = &runtimeapi.RuntimeStatus{Conditions: []*runtimeapi.RuntimeCondition{
		{Type: runtimeapi.RuntimeReady, Status: true},
		{Type: runtimeapi.NetworkReady, Status: true},
	}}
	// The kubelet (cgroupDriver: cgroupfs) asks the runtime for its driver.
	s.rt.FakeLinuxConfiguration = &runtimeapi.LinuxRuntimeConfiguration{CgroupDriver: runtimeapi.CgroupDriver_CGROUPFS}
	s.img.SetFakeImageSize(fakeImageSize)

	if cfg.recordDir != "" {
		if err := os.MkdirAll(cfg.recordDir, 0o755); err != nil {
			return nil, fmt.Errorf("record dir: %w", err)
		}
	}
	if cfg.imageFsPath != "" {
		if err := os.MkdirAll(cfg.imageFsPath, 0o755); err != nil {
			// Without a mountpoint the kubelet still gets used bytes, just no capacity.
			log.Printf("warning: cannot create image fs path %s: %v", cfg.imageFsPath, err)
		} else {
			s.imageFsID = &runtimeapi.FilesystemIdentifier{Mountpoint: cfg.imageFsPath}
		}
	}
	return s, nil
}

// run serves until ctx is cancelled. ready, if not nil, is closed once the
// socket accepts connections.
func run(ctx context.Context, cfg config, ready chan<- struct{}) error {
	s, err := newServer(cfg)
	if err != nil {
		return err
	}
	lis, err := listenUnix(cfg.listen)
	if err != nil {
		return err
	}
	defer os.Remove(cfg.listen)

	gs := grpc.NewServer(
		grpc.ChainUnaryInterceptor(s.unaryInterceptor),
		grpc.ChainStreamInterceptor(s.streamInterceptor),
	)
	runtimeapi.RegisterRuntimeServiceServer(gs, s)
	runtimeapi.RegisterImageServiceServer(gs, s)

	janitorDone := make(chan struct{})
	janitorCtx, stopJanitor := context.WithCancel(ctx)
	go func() { defer close(janitorDone); s.janitor(janitorCtx) }()

	serveErr := make(chan error, 1)
	go func() { serveErr <- gs.Serve(lis) }()
	log.Printf("serving CRI on %s (CDI spec dirs %v, record dir %q)", cfg.listen, cfg.cdiSpecDirs, cfg.recordDir)
	if ready != nil {
		close(ready)
	}

	select {
	case <-ctx.Done():
		log.Printf("shutting down")
	case err = <-serveErr:
	}
	stopJanitor()
	<-janitorDone
	done := make(chan struct{})
	go func() { gs.GracefulStop(); close(done) }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		gs.Stop()
	}
	s.shutdown()
	if err := os.Remove(cfg.listen); err != nil && !errors.Is(err, fs.ErrNotExist) {
		log.Printf("warning: removing socket: %v", err)
	}
	if err != nil && !errors.Is(err, grpc.ErrServerStopped) {
		return err
	}
	return nil
}

// listenUnix listens on path, removing a stale socket first. Anything that
// is not a socket is left alone and reported.
func listenUnix(path string) (net.Listener, error) {
	if fi, err := os.Lstat(path); err == nil {
		if fi.Mode().Type() != fs.ModeSocket {
			return nil, fmt.Errorf("%s exists and is not a socket", path)
		}
		if err := os.Remove(path); err != nil {
			return nil, fmt.Errorf("removing stale socket: %w", err)
		}
	} else if !errors.Is(err, fs.ErrNotExist) {
		return nil, err
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return nil, err
	}
	return net.Listen("unix", path)
}

// janitor trims the call logs the fakes keep for their own unit tests; a
// long-running kubelet would otherwise grow them without bound.
func (s *server) janitor(ctx context.Context) {
	t := time.NewTicker(30 * time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		s.rt.Lock()
		s.rt.Called = nil
		s.rt.Unlock()
		s.img.Lock()
		s.img.Called = nil
		s.img.Unlock()
	}
}

// shutdown stops the exit timers.
func (s *server) shutdown() {
	s.rt.Lock()
	defer s.rt.Unlock()
	s.closing = true
	for _, x := range s.extra {
		if x.timer != nil {
			x.timer.Stop()
		}
	}
}

// ---- interceptors ----

// normalizeError gives the fake's plain "... not found" errors the NotFound
// code real runtimes use (the kubelet checks for it with crierror.IsNotFound).
func normalizeError(err error) error {
	if err == nil {
		return nil
	}
	if _, ok := status.FromError(err); ok {
		return err
	}
	if strings.Contains(err.Error(), "not found") {
		return status.Error(codes.NotFound, err.Error())
	}
	return err
}

func (s *server) logCall(method string, start time.Time, err error) {
	if err != nil {
		if status.Code(err) == codes.NotFound || status.Code(err) == codes.Unimplemented {
			if s.cfg.verbose {
				log.Printf("%s (%v): %v", method, time.Since(start), err)
			}
			return
		}
		log.Printf("%s failed (%v): %v", method, time.Since(start), err)
		return
	}
	if s.cfg.verbose {
		log.Printf("%s ok (%v)", method, time.Since(start))
	}
}

func (s *server) unaryInterceptor(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	start := time.Now()
	resp, err := handler(ctx, req)
	err = normalizeError(err)
	s.logCall(info.FullMethod, start, err)
	return resp, err
}

func (s *server) streamInterceptor(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	start := time.Now()
	err := normalizeError(handler(srv, ss))
	s.logCall(info.FullMethod, start, err)
	return err
}

// ---- helpers ----

func randomID() string {
	b := make([]byte, 32)
	if _, err := rand.Read(b); err != nil {
		panic(err)
	}
	return hex.EncodeToString(b)
}

func matchLabels(selector, labels map[string]string) bool {
	for k, v := range selector {
		if got, ok := labels[k]; !ok || got != v {
			return false
		}
	}
	return true
}

func notFound(kind, id string) error {
	return status.Errorf(codes.NotFound, "%s %q not found", kind, id)
}

// writeRecordLocked writes the container's record; caller holds rt's lock.
func (s *server) writeRecordLocked(x *containerExtra) {
	if s.cfg.recordDir == "" || x == nil || x.record == nil {
		return
	}
	if err := writeRecord(s.cfg.recordDir, x.record); err != nil {
		log.Printf("warning: writing record for container %s: %v", x.record.ContainerID, err)
	}
}

// appendLog appends lines in the CRI log format to the container's log file.
func appendLog(path string, lines ...string) {
	if path == "" {
		return
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		log.Printf("warning: creating log dir for %s: %v", path, err)
		return
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o640)
	if err != nil {
		log.Printf("warning: opening log %s: %v", path, err)
		return
	}
	defer f.Close()
	var b strings.Builder
	for _, l := range lines {
		// One CRI log line per input line: "<RFC3339Nano> stdout F <text>".
		for _, part := range strings.Split(l, "\n") {
			b.WriteString(time.Now().UTC().Format(time.RFC3339Nano))
			b.WriteString(" stdout F ")
			b.WriteString(part)
			b.WriteByte('\n')
		}
	}
	if _, err := f.WriteString(b.String()); err != nil {
		log.Printf("warning: writing log %s: %v", path, err)
	}
}

// exitLocked moves a running container to EXITED; caller holds rt's lock.
func (s *server) exitLocked(c *apitest.FakeContainer, code int32, by string) {
	if c.State != runtimeapi.ContainerState_CONTAINER_RUNNING {
		return
	}
	now := time.Now()
	c.State = runtimeapi.ContainerState_CONTAINER_EXITED
	c.ExitCode = code
	c.FinishedAt = now.UnixNano()
	if code == 0 {
		c.Reason = "Completed"
	} else {
		c.Reason = "Error"
	}
	x := s.extra[c.Id]
	if x == nil {
		return
	}
	if x.timer != nil {
		x.timer.Stop()
		x.timer = nil
	}
	appendLog(c.LogPath, fmt.Sprintf("[%s] exited with code %d (%s)", runtimeName, code, by))
	if r := x.record; r != nil {
		ec := code
		r.State = "exited"
		r.ExitCode = &ec
		r.Reason = c.Reason
		r.ExitedBy = by
		r.FinishedAt = timestamp(now)
		r.Events = append(r.Events, recordEvent{Event: "exited", At: r.FinishedAt, ExitCode: &ec})
		s.writeRecordLocked(x)
	}
	log.Printf("container %s (%s) exited with code %d (%s)", c.Id, c.GetMetadata().GetName(), code, by)
}

// removeContainerLocked forcibly stops and deletes a container; caller holds rt's lock.
func (s *server) removeContainerLocked(id, by string) {
	c, ok := s.rt.Containers[id]
	if !ok {
		return
	}
	s.exitLocked(c, killedExitCode, by)
	if x := s.extra[id]; x != nil {
		if x.timer != nil {
			x.timer.Stop()
		}
		if r := x.record; r != nil {
			r.RemovedAt = timestamp(time.Now())
			r.Events = append(r.Events, recordEvent{Event: "removed", At: r.RemovedAt})
			s.writeRecordLocked(x)
		}
	}
	delete(s.rt.Containers, id)
	delete(s.extra, id)
}

// allocateIPLocked hands out 10.88.x.y addresses; caller holds rt's lock.
func (s *server) allocateIPLocked() string {
	for {
		n := s.nextIP
		s.nextIP++
		if s.nextIP >= 1<<16 {
			s.nextIP = 2
		}
		if lo := n & 0xff; lo == 0 || lo == 255 {
			continue
		}
		return fmt.Sprintf("10.88.%d.%d", (n>>8)&0xff, n&0xff)
	}
}

// ---- RuntimeService overrides ----

func (s *server) Version(_ context.Context, _ *runtimeapi.VersionRequest) (*runtimeapi.VersionResponse, error) {
	return &runtimeapi.VersionResponse{
		Version:           "0.1.0",
		RuntimeName:       runtimeName,
		RuntimeVersion:    runtimeVersion,
		RuntimeApiVersion: apiVersion,
	}, nil
}

func (s *server) RunPodSandbox(_ context.Context, req *runtimeapi.RunPodSandboxRequest) (*runtimeapi.RunPodSandboxResponse, error) {
	cfg := req.GetConfig()
	if cfg.GetMetadata() == nil {
		return nil, status.Error(codes.InvalidArgument, "sandbox config metadata is required")
	}
	s.rt.Lock()
	defer s.rt.Unlock()
	id := randomID()
	ip := ""
	nsOpts := cfg.GetLinux().GetSecurityContext().GetNamespaceOptions()
	if nsOpts.GetNetwork() != runtimeapi.NamespaceMode_NODE {
		ip = s.allocateIPLocked()
	}
	s.rt.Sandboxes[id] = &apitest.FakePodSandbox{
		PodSandboxStatus: runtimeapi.PodSandboxStatus{
			Id:        id,
			Metadata:  cfg.GetMetadata(),
			State:     runtimeapi.PodSandboxState_SANDBOX_READY,
			CreatedAt: time.Now().UnixNano(),
			Network:   &runtimeapi.PodSandboxNetworkStatus{Ip: ip},
			// The kubelet compares these with the pod's to decide whether
			// the sandbox must be recreated.
			Linux:          &runtimeapi.LinuxPodSandboxStatus{Namespaces: &runtimeapi.Namespace{Options: nsOpts}},
			Labels:         cfg.GetLabels(),
			Annotations:    cfg.GetAnnotations(),
			RuntimeHandler: req.GetRuntimeHandler(),
		},
		RuntimeHandler: req.GetRuntimeHandler(),
	}
	md := cfg.GetMetadata()
	log.Printf("sandbox %s created for pod %s/%s (ip %q)", id, md.GetNamespace(), md.GetName(), ip)
	return &runtimeapi.RunPodSandboxResponse{PodSandboxId: id}, nil
}

func (s *server) StopPodSandbox(_ context.Context, req *runtimeapi.StopPodSandboxRequest) (*runtimeapi.StopPodSandboxResponse, error) {
	id := req.GetPodSandboxId()
	s.rt.Lock()
	defer s.rt.Unlock()
	sb, ok := s.rt.Sandboxes[id]
	if !ok {
		return nil, notFound("pod sandbox", id)
	}
	for _, c := range s.rt.Containers {
		if c.SandboxID == id {
			s.exitLocked(c, killedExitCode, "StopPodSandbox")
		}
	}
	sb.State = runtimeapi.PodSandboxState_SANDBOX_NOTREADY
	return &runtimeapi.StopPodSandboxResponse{}, nil
}

func (s *server) RemovePodSandbox(_ context.Context, req *runtimeapi.RemovePodSandboxRequest) (*runtimeapi.RemovePodSandboxResponse, error) {
	id := req.GetPodSandboxId()
	s.rt.Lock()
	defer s.rt.Unlock()
	for cid, c := range s.rt.Containers {
		if c.SandboxID == id {
			s.removeContainerLocked(cid, "RemovePodSandbox")
		}
	}
	delete(s.rt.Sandboxes, id)
	return &runtimeapi.RemovePodSandboxResponse{}, nil
}

func (s *server) CreateContainer(_ context.Context, req *runtimeapi.CreateContainerRequest) (*runtimeapi.CreateContainerResponse, error) {
	cfg := req.GetConfig()
	if cfg.GetMetadata() == nil || cfg.GetImage() == nil {
		return nil, status.Error(codes.InvalidArgument, "container config metadata and image are required")
	}
	sandboxID := req.GetPodSandboxId()
	sbCfg := req.GetSandboxConfig()
	id := randomID()
	meta := cfg.GetMetadata()

	s.rt.Lock()
	sb, ok := s.rt.Sandboxes[sandboxID]
	if ok {
		// Like containerd's name reservation: one container per (sandbox, name, attempt).
		for _, c := range s.rt.Containers {
			if c.SandboxID == sandboxID && c.GetMetadata().GetName() == meta.GetName() && c.GetMetadata().GetAttempt() == meta.GetAttempt() {
				s.rt.Unlock()
				return nil, status.Errorf(codes.AlreadyExists, "failed to reserve container name %q: name is reserved for %q",
					fmt.Sprintf("%s_%d", meta.GetName(), meta.GetAttempt()), c.Id)
			}
		}
	}
	s.rt.Unlock()
	if !ok {
		return nil, notFound("pod sandbox", sandboxID)
	}
	podMeta := sb.GetMetadata()
	if sbCfg.GetMetadata() != nil {
		podMeta = sbCfg.GetMetadata()
	}

	// CDI first: a device that cannot be resolved fails CreateContainer,
	// exactly where containerd fails it (while building the container spec).
	res, err := s.cdi.inject(id, cfg)
	if err != nil {
		log.Printf("CreateContainer %s/%s container %s: %v", podMeta.GetNamespace(), podMeta.GetName(), meta.GetName(), err)
		return nil, status.Errorf(codes.Unknown, "failed to create containerd container: %v", err)
	}

	logPath := ""
	if sbCfg.GetLogDirectory() != "" && cfg.GetLogPath() != "" {
		logPath = filepath.Join(sbCfg.GetLogDirectory(), cfg.GetLogPath())
	}
	now := time.Now()
	var resources *runtimeapi.ContainerResources
	var linuxRes *runtimeapi.LinuxContainerResources
	if r := cfg.GetLinux().GetResources(); r != nil {
		linuxRes = proto.Clone(r).(*runtimeapi.LinuxContainerResources)
		resources = &runtimeapi.ContainerResources{Linux: proto.Clone(r).(*runtimeapi.LinuxContainerResources)}
	}
	c := &apitest.FakeContainer{
		ContainerStatus: runtimeapi.ContainerStatus{
			Id:          id,
			Metadata:    meta,
			Image:       cfg.GetImage(),
			ImageRef:    cfg.GetImage().GetImage(),
			CreatedAt:   now.UnixNano(),
			State:       runtimeapi.ContainerState_CONTAINER_CREATED,
			Labels:      cfg.GetLabels(),
			Annotations: cfg.GetAnnotations(),
			Mounts:      cfg.GetMounts(),
			LogPath:     logPath,
			Resources:   resources,
		},
		SandboxID:      sandboxID,
		LinuxResources: linuxRes,
	}
	rec := &containerRecord{
		PodNamespace:         podMeta.GetNamespace(),
		PodName:              podMeta.GetName(),
		PodUID:               podMeta.GetUid(),
		SandboxID:            sandboxID,
		ContainerName:        meta.GetName(),
		ContainerID:          id,
		Attempt:              meta.GetAttempt(),
		Image:                cfg.GetImage().GetImage(),
		Command:              nonNil(append([]string(nil), cfg.GetCommand()...)),
		Args:                 nonNil(append([]string(nil), cfg.GetArgs()...)),
		CDIDevices:           res.fromField,
		CDIAnnotationDevices: res.fromAnnotations,
		InjectedCDIDevices:   res.injected,
		LogPath:              logPath,
		State:                "created",
		CreatedAt:            timestamp(now),
	}
	rec.fillFromSpec(res.spec)
	rec.Events = []recordEvent{{Event: "created", At: rec.CreatedAt}}
	x := &containerExtra{behaviour: modelProcess(cfg.GetCommand(), cfg.GetArgs()), record: rec}

	s.rt.Lock()
	defer s.rt.Unlock()
	if _, ok := s.rt.Sandboxes[sandboxID]; !ok {
		return nil, notFound("pod sandbox", sandboxID)
	}
	s.rt.Containers[id] = c
	s.extra[id] = x
	s.writeRecordLocked(x)
	log.Printf("container %s created: %s/%s %s, command %q, CDI devices %v, %d device nodes",
		id, rec.PodNamespace, rec.PodName, rec.ContainerName, append(rec.Command, rec.Args...), rec.InjectedCDIDevices, len(rec.DeviceNodes))
	return &runtimeapi.CreateContainerResponse{ContainerId: id}, nil
}

func (s *server) StartContainer(_ context.Context, req *runtimeapi.StartContainerRequest) (*runtimeapi.StartContainerResponse, error) {
	id := req.GetContainerId()
	s.rt.Lock()
	defer s.rt.Unlock()
	c, ok := s.rt.Containers[id]
	if !ok {
		return nil, notFound("container", id)
	}
	if c.State != runtimeapi.ContainerState_CONTAINER_CREATED {
		return nil, status.Errorf(codes.FailedPrecondition, "container %q is in %s state", id, c.State)
	}
	if sb, ok := s.rt.Sandboxes[c.SandboxID]; !ok || sb.State != runtimeapi.PodSandboxState_SANDBOX_READY {
		return nil, status.Errorf(codes.FailedPrecondition, "sandbox %q of container %q is not ready", c.SandboxID, id)
	}
	now := time.Now()
	c.State = runtimeapi.ContainerState_CONTAINER_RUNNING
	c.StartedAt = now.UnixNano()
	x := s.extra[id]
	if x == nil {
		x = &containerExtra{}
		s.extra[id] = x
	}
	if r := x.record; r != nil {
		lines := []string{fmt.Sprintf("[%s] started %s/%s %s: %q", runtimeName, r.PodNamespace, r.PodName, r.ContainerName, append(append([]string{}, r.Command...), r.Args...))}
		lines = append(lines, r.Env...)
		for _, d := range r.DeviceNodes {
			lines = append(lines, fmt.Sprintf("[%s] device %s %s %d:%d", runtimeName, d.Path, d.Type, d.Major, d.Minor))
		}
		appendLog(c.LogPath, lines...)
		r.State = "running"
		r.StartedAt = timestamp(now)
		r.Events = append(r.Events, recordEvent{Event: "started", At: r.StartedAt})
		s.writeRecordLocked(x)
	} else {
		appendLog(c.LogPath, fmt.Sprintf("[%s] started", runtimeName))
	}
	if b := x.behaviour; b.exits && !s.closing {
		code := b.exitCode
		x.timer = time.AfterFunc(b.after, func() {
			s.rt.Lock()
			defer s.rt.Unlock()
			if cur, ok := s.rt.Containers[id]; ok && cur == c {
				s.exitLocked(c, code, "process")
			}
		})
	}
	log.Printf("container %s started (%s)", id, describe(x.behaviour))
	return &runtimeapi.StartContainerResponse{}, nil
}

func describe(b behaviour) string {
	if !b.exits {
		return "runs until stopped"
	}
	return fmt.Sprintf("exits %d after %v", b.exitCode, b.after)
}

func (s *server) StopContainer(_ context.Context, req *runtimeapi.StopContainerRequest) (*runtimeapi.StopContainerResponse, error) {
	id := req.GetContainerId()
	s.rt.Lock()
	defer s.rt.Unlock()
	c, ok := s.rt.Containers[id]
	if !ok {
		return nil, notFound("container", id)
	}
	// Idempotent: an exited (or never started) container is left as is.
	s.exitLocked(c, killedExitCode, "StopContainer")
	return &runtimeapi.StopContainerResponse{}, nil
}

func (s *server) RemoveContainer(_ context.Context, req *runtimeapi.RemoveContainerRequest) (*runtimeapi.RemoveContainerResponse, error) {
	s.rt.Lock()
	defer s.rt.Unlock()
	// Idempotent: removing an unknown container succeeds.
	s.removeContainerLocked(req.GetContainerId(), "RemoveContainer")
	return &runtimeapi.RemoveContainerResponse{}, nil
}

func (s *server) UpdateContainerResources(_ context.Context, req *runtimeapi.UpdateContainerResourcesRequest) (*runtimeapi.UpdateContainerResourcesResponse, error) {
	id := req.GetContainerId()
	s.rt.Lock()
	defer s.rt.Unlock()
	c, ok := s.rt.Containers[id]
	if !ok {
		return nil, notFound("container", id)
	}
	if r := req.GetLinux(); r != nil {
		c.LinuxResources = proto.Clone(r).(*runtimeapi.LinuxContainerResources)
		c.Resources = &runtimeapi.ContainerResources{Linux: proto.Clone(r).(*runtimeapi.LinuxContainerResources)}
	}
	return &runtimeapi.UpdateContainerResourcesResponse{}, nil
}

func (s *server) ReopenContainerLog(_ context.Context, req *runtimeapi.ReopenContainerLogRequest) (*runtimeapi.ReopenContainerLogResponse, error) {
	id := req.GetContainerId()
	s.rt.Lock()
	defer s.rt.Unlock()
	c, ok := s.rt.Containers[id]
	if !ok {
		return nil, notFound("container", id)
	}
	if c.State != runtimeapi.ContainerState_CONTAINER_RUNNING {
		return nil, status.Errorf(codes.FailedPrecondition, "container %q is not running", id)
	}
	if c.LogPath != "" {
		f, err := os.OpenFile(c.LogPath, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o640)
		if err != nil {
			return nil, status.Errorf(codes.Internal, "reopening log %s: %v", c.LogPath, err)
		}
		f.Close()
	}
	return &runtimeapi.ReopenContainerLogResponse{}, nil
}

// ExecSync answers exec probes: a running container runs any command
// successfully with empty output.
func (s *server) ExecSync(_ context.Context, req *runtimeapi.ExecSyncRequest) (*runtimeapi.ExecSyncResponse, error) {
	id := req.GetContainerId()
	s.rt.Lock()
	defer s.rt.Unlock()
	c, ok := s.rt.Containers[id]
	if !ok {
		return nil, notFound("container", id)
	}
	if c.State != runtimeapi.ContainerState_CONTAINER_RUNNING {
		return nil, status.Errorf(codes.FailedPrecondition, "container %q is not running", id)
	}
	return &runtimeapi.ExecSyncResponse{Stdout: []byte{}, Stderr: []byte{}, ExitCode: 0}, nil
}

var errNoStreaming = status.Error(codes.Unimplemented, runtimeName+" has no processes: streaming (exec/attach/port-forward) is not supported")

func (s *server) Exec(context.Context, *runtimeapi.ExecRequest) (*runtimeapi.ExecResponse, error) {
	return nil, errNoStreaming
}

func (s *server) Attach(context.Context, *runtimeapi.AttachRequest) (*runtimeapi.AttachResponse, error) {
	return nil, errNoStreaming
}

func (s *server) PortForward(context.Context, *runtimeapi.PortForwardRequest) (*runtimeapi.PortForwardResponse, error) {
	return nil, errNoStreaming
}

func (s *server) CheckpointContainer(context.Context, *runtimeapi.CheckpointContainerRequest) (*runtimeapi.CheckpointContainerResponse, error) {
	return nil, status.Error(codes.Unimplemented, "checkpointing is not supported by "+runtimeName)
}

func (s *server) CheckpointPod(context.Context, *runtimeapi.CheckpointPodRequest) (*runtimeapi.CheckpointPodResponse, error) {
	return nil, status.Error(codes.Unimplemented, "checkpointing is not supported by "+runtimeName)
}

func (s *server) RestorePod(context.Context, *runtimeapi.RestorePodRequest) (*runtimeapi.RestorePodResponse, error) {
	return nil, status.Error(codes.Unimplemented, "restoring is not supported by "+runtimeName)
}

// GetContainerEvents is only used by the (alpha, off by default) evented
// PLEG, which falls back to relisting when the runtime does not support it.
func (s *server) GetContainerEvents(*runtimeapi.GetEventsRequest, runtimeapi.RuntimeService_GetContainerEventsServer) error {
	return status.Error(codes.Unimplemented, "container events are not supported by "+runtimeName)
}

// ---- stats: all zero, but well-formed ----

func (s *server) containerStatsLocked(c *apitest.FakeContainer, now int64) *runtimeapi.ContainerStats {
	zero := func() *runtimeapi.UInt64Value { return &runtimeapi.UInt64Value{Value: 0} }
	return &runtimeapi.ContainerStats{
		Attributes: &runtimeapi.ContainerAttributes{
			Id:          c.Id,
			Metadata:    c.Metadata,
			Labels:      c.Labels,
			Annotations: c.Annotations,
		},
		Cpu: &runtimeapi.CpuUsage{Timestamp: now, UsageCoreNanoSeconds: zero(), UsageNanoCores: zero()},
		Memory: &runtimeapi.MemoryUsage{Timestamp: now, WorkingSetBytes: zero(), UsageBytes: zero(), RssBytes: zero(),
			PageFaults: zero(), MajorPageFaults: zero()},
		// No FsId: the writable layer has no filesystem of its own.
		WritableLayer: &runtimeapi.FilesystemUsage{Timestamp: now, UsedBytes: zero(), InodesUsed: zero()},
	}
}

func (s *server) sandboxStatsLocked(sb *apitest.FakePodSandbox, now int64) *runtimeapi.PodSandboxStats {
	zero := func() *runtimeapi.UInt64Value { return &runtimeapi.UInt64Value{Value: 0} }
	linux := &runtimeapi.LinuxPodSandboxStats{
		Cpu:        &runtimeapi.CpuUsage{Timestamp: now, UsageCoreNanoSeconds: zero(), UsageNanoCores: zero()},
		Memory:     &runtimeapi.MemoryUsage{Timestamp: now, WorkingSetBytes: zero(), UsageBytes: zero(), RssBytes: zero(), PageFaults: zero(), MajorPageFaults: zero()},
		Process:    &runtimeapi.ProcessUsage{Timestamp: now, ProcessCount: zero()},
		Containers: []*runtimeapi.ContainerStats{},
	}
	for _, c := range s.rt.Containers {
		if c.SandboxID == sb.Id && c.State == runtimeapi.ContainerState_CONTAINER_RUNNING {
			linux.Containers = append(linux.Containers, s.containerStatsLocked(c, now))
		}
	}
	return &runtimeapi.PodSandboxStats{
		Attributes: &runtimeapi.PodSandboxAttributes{Id: sb.Id, Metadata: sb.Metadata, Labels: sb.Labels, Annotations: sb.Annotations},
		Linux:      linux,
	}
}

func (s *server) ContainerStats(_ context.Context, req *runtimeapi.ContainerStatsRequest) (*runtimeapi.ContainerStatsResponse, error) {
	id := req.GetContainerId()
	s.rt.Lock()
	defer s.rt.Unlock()
	c, ok := s.rt.Containers[id]
	if !ok {
		return nil, notFound("container", id)
	}
	return &runtimeapi.ContainerStatsResponse{Stats: s.containerStatsLocked(c, time.Now().UnixNano())}, nil
}

func (s *server) listContainerStats(f *runtimeapi.ContainerStatsFilter) []*runtimeapi.ContainerStats {
	s.rt.Lock()
	defer s.rt.Unlock()
	now := time.Now().UnixNano()
	out := []*runtimeapi.ContainerStats{}
	for _, c := range s.rt.Containers {
		if c.State != runtimeapi.ContainerState_CONTAINER_RUNNING {
			continue
		}
		if f.GetId() != "" && f.GetId() != c.Id {
			continue
		}
		if f.GetPodSandboxId() != "" && f.GetPodSandboxId() != c.SandboxID {
			continue
		}
		if !matchLabels(f.GetLabelSelector(), c.Labels) {
			continue
		}
		out = append(out, s.containerStatsLocked(c, now))
	}
	return out
}

func (s *server) ListContainerStats(_ context.Context, req *runtimeapi.ListContainerStatsRequest) (*runtimeapi.ListContainerStatsResponse, error) {
	return &runtimeapi.ListContainerStatsResponse{Stats: s.listContainerStats(req.GetFilter())}, nil
}

func (s *server) StreamContainerStats(req *runtimeapi.StreamContainerStatsRequest, stream runtimeapi.RuntimeService_StreamContainerStatsServer) error {
	return stream.Send(&runtimeapi.StreamContainerStatsResponse{ContainerStats: s.listContainerStats(req.GetFilter())})
}

func (s *server) PodSandboxStats(_ context.Context, req *runtimeapi.PodSandboxStatsRequest) (*runtimeapi.PodSandboxStatsResponse, error) {
	id := req.GetPodSandboxId()
	s.rt.Lock()
	defer s.rt.Unlock()
	sb, ok := s.rt.Sandboxes[id]
	if !ok {
		return nil, notFound("pod sandbox", id)
	}
	return &runtimeapi.PodSandboxStatsResponse{Stats: s.sandboxStatsLocked(sb, time.Now().UnixNano())}, nil
}

func (s *server) listPodSandboxStats(f *runtimeapi.PodSandboxStatsFilter) []*runtimeapi.PodSandboxStats {
	s.rt.Lock()
	defer s.rt.Unlock()
	now := time.Now().UnixNano()
	out := []*runtimeapi.PodSandboxStats{}
	for _, sb := range s.rt.Sandboxes {
		if sb.State != runtimeapi.PodSandboxState_SANDBOX_READY {
			continue
		}
		if f.GetId() != "" && f.GetId() != sb.Id {
			continue
		}
		if !matchLabels(f.GetLabelSelector(), sb.Labels) {
			continue
		}
		out = append(out, s.sandboxStatsLocked(sb, now))
	}
	return out
}

func (s *server) ListPodSandboxStats(_ context.Context, req *runtimeapi.ListPodSandboxStatsRequest) (*runtimeapi.ListPodSandboxStatsResponse, error) {
	return &runtimeapi.ListPodSandboxStatsResponse{Stats: s.listPodSandboxStats(req.GetFilter())}, nil
}

func (s *server) StreamPodSandboxStats(req *runtimeapi.StreamPodSandboxStatsRequest, stream runtimeapi.RuntimeService_StreamPodSandboxStatsServer) error {
	return stream.Send(&runtimeapi.StreamPodSandboxStatsResponse{PodSandboxStats: s.listPodSandboxStats(req.GetFilter())})
}

// ---- ImageService overrides ----

// ImageFsInfo reports one filesystem (the --image-fs-path directory) for both
// images and containers, so the kubelet sees no split image filesystem.
func (s *server) ImageFsInfo(_ context.Context, _ *runtimeapi.ImageFsInfoRequest) (*runtimeapi.ImageFsInfoResponse, error) {
	s.img.Lock()
	var used uint64
	n := uint64(len(s.img.Images))
	for _, im := range s.img.Images {
		used += im.GetSize()
	}
	s.img.Unlock()
	now := time.Now().UnixNano()
	usage := func() *runtimeapi.FilesystemUsage {
		u := &runtimeapi.FilesystemUsage{
			Timestamp:  now,
			UsedBytes:  &runtimeapi.UInt64Value{Value: used},
			InodesUsed: &runtimeapi.UInt64Value{Value: n},
		}
		if s.imageFsID != nil {
			u.FsId = &runtimeapi.FilesystemIdentifier{Mountpoint: s.imageFsID.GetMountpoint()}
		}
		return u
	}
	return &runtimeapi.ImageFsInfoResponse{
		ImageFilesystems:     []*runtimeapi.FilesystemUsage{usage()},
		ContainerFilesystems: []*runtimeapi.FilesystemUsage{usage()},
	}, nil
}

// PullImage always succeeds for any image name (the fake records it so it is
// listed afterwards); it only adds a log line.
func (s *server) PullImage(ctx context.Context, req *runtimeapi.PullImageRequest) (*runtimeapi.PullImageResponse, error) {
	resp, err := s.RemoteRuntime.PullImage(ctx, req)
	if err == nil {
		log.Printf("image %q pulled", req.GetImage().GetImage())
	}
	return resp, err
}

var _ runtimeapi.RuntimeServiceServer = (*server)(nil)
var _ runtimeapi.ImageServiceServer = (*server)(nil)
