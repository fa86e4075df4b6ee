package main

import (
	"fmt"
	"log"
	"sort"
	"sync"

	oci "github.com/opencontainers/runtime-spec/specs-go"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
	"tags.cncf.io/container-device-interface/pkg/cdi"
)

// cdiInjector resolves CDI devices the way containerd's CRI plugin does:
// the device names come from ContainerConfig.CDI_devices plus the legacy
// cdi.k8s.io/* annotations, the registry is refreshed right before the
// injection (so per-claim specs written a moment ago are seen), refresh
// errors are only warnings, and injection into the OCI spec either succeeds
// for all devices or fails CreateContainer.
type cdiInjector struct {
	mu    sync.Mutex // makes refresh + inject one step
	cache *cdi.Cache
}

func newCDIInjector(specDirs []string) (*cdiInjector, error) {
	cache, err := cdi.NewCache(cdi.WithSpecDirs(specDirs...), cdi.WithAutoRefresh(false))
	if err != nil {
		return nil, err
	}
	return &cdiInjector{cache: cache}, nil
}

// cdiResult is what CDI did to a container.
type cdiResult struct {
	fromField       []string
	fromAnnotations []string
	injected        []string
	spec            *oci.Spec
}

// baseSpec is the minimal OCI spec the CDI edits are applied to: the
// container's process (argv, env, user) and an empty Linux section.
func baseSpec(cfg *runtimeapi.ContainerConfig) *oci.Spec {
	env := make([]string, 0, len(cfg.GetEnvs()))
	for _, kv := range cfg.GetEnvs() {
		env = append(env, kv.GetKey()+"="+string(kv.GetValue()))
	}
	proc := &oci.Process{
		Args: append(append([]string{}, cfg.GetCommand()...), cfg.GetArgs()...),
		Env:  env,
		Cwd:  "/",
	}
	if wd := cfg.GetWorkingDir(); wd != "" {
		proc.Cwd = wd
	}
	sc := cfg.GetLinux().GetSecurityContext()
	if u := sc.GetRunAsUser(); u != nil {
		proc.User.UID = uint32(u.GetValue())
	}
	if g := sc.GetRunAsGroup(); g != nil {
		proc.User.GID = uint32(g.GetValue())
	}
	return &oci.Spec{
		Version: oci.Version,
		Process: proc,
		Linux:   &oci.Linux{},
	}
}

// inject builds the base spec and applies the CDI edits of all requested
// devices. The error text follows containerd's:
// "CDI device injection failed: unresolvable CDI devices <names>".
func (c *cdiInjector) inject(containerID string, cfg *runtimeapi.ContainerConfig) (*cdiResult, error) {
	res := &cdiResult{fromField: []string{}, fromAnnotations: []string{}, injected: []string{}, spec: baseSpec(cfg)}
	seen := map[string]bool{}
	for _, d := range cfg.GetCDIDevices() {
		name := d.GetName()
		res.fromField = append(res.fromField, name)
		if !seen[name] {
			seen[name] = true
			res.injected = append(res.injected, name)
		}
	}
	_, fromAnnotations, err := cdi.ParseAnnotations(cfg.GetAnnotations())
	if err != nil {
		return res, fmt.Errorf("failed to parse CDI device annotations: %w", err)
	}
	// ParseAnnotations walks a map: keep the output deterministic.
	sort.Strings(fromAnnotations)
	for _, name := range fromAnnotations {
		res.fromAnnotations = append(res.fromAnnotations, name)
		if !seen[name] {
			seen[name] = true
			res.injected = append(res.injected, name)
		}
	}
	if len(res.injected) == 0 {
		return res, nil
	}

	c.mu.Lock()
	defer c.mu.Unlock()
	if err := c.cache.Refresh(); err != nil {
		// Like containerd: a broken spec of some vendor must not prevent
		// injecting devices of another; CDI fails the injection if needed.
		log.Printf("warning: container %s: CDI registry refresh failed: %v", containerID, err)
	}
	if _, err := c.cache.InjectDevices(res.spec, res.injected...); err != nil {
		return res, fmt.Errorf("CDI device injection failed: %w", err)
	}
	return res, nil
}
