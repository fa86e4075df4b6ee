package main

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	oci "github.com/opencontainers/runtime-spec/specs-go"
)

// containerRecord is the JSON document written for every created container.
// Field names are part of the contract with the e2e tests (see README.md).
type containerRecord struct {
	PodNamespace  string `json:"podNamespace"`
	PodName       string `json:"podName"`
	PodUID        string `json:"podUID"`
	SandboxID     string `json:"sandboxID"`
	ContainerName string `json:"containerName"`
	ContainerID   string `json:"containerID"`
	Attempt       uint32 `json:"attempt"`
	Image         string `json:"image"`
	// Command and Args as given in the CRI ContainerConfig.
	Command []string `json:"command"`
	Args    []string `json:"args"`
	// CDIDevices are the names from ContainerConfig.CDI_devices, in order.
	CDIDevices []string `json:"cdiDevices"`
	// CDIAnnotationDevices are the names from legacy cdi.k8s.io/* annotations.
	CDIAnnotationDevices []string `json:"cdiAnnotationDevices"`
	// InjectedCDIDevices is the de-duplicated union that was resolved and injected.
	InjectedCDIDevices []string `json:"injectedCDIDevices"`
	// DeviceNodes, Env, Mounts and Hooks are read back from the OCI spec after
	// the CDI edits were applied. The base spec holds only the container's env,
	// so every device node, mount and hook comes from CDI.
	DeviceNodes []deviceNodeRecord `json:"deviceNodes"`
	Env         []string           `json:"env"`
	Mounts      []mountRecord      `json:"mounts"`
	Hooks       []hookRecord       `json:"hooks"`
	LogPath     string             `json:"logPath"`
	// State is "created", "running" or "exited" (the CRI state).
	State string `json:"state"`
	// ExitCode is null until the container exited.
	ExitCode *int32 `json:"exitCode"`
	// Reason is "Completed" (exit 0) or "Error" once exited.
	Reason string `json:"reason"`
	// ExitedBy is "process" (the modelled command ended), "StopContainer",
	// "StopPodSandbox" or "RemoveContainer"/"RemovePodSandbox" (forced).
	ExitedBy string `json:"exitedBy"`
	// Timestamps, RFC 3339 with nanoseconds, UTC; empty when not reached.
	CreatedAt  string `json:"createdAt"`
	StartedAt  string `json:"startedAt"`
	FinishedAt string `json:"finishedAt"`
	RemovedAt  string `json:"removedAt"`
	// Events lists the transitions in order: created, started, exited, removed.
	Events []recordEvent `json:"events"`
}

type deviceNodeRecord struct {
	Path     string  `json:"path"`
	Type     string  `json:"type"`
	Major    int64   `json:"major"`
	Minor    int64   `json:"minor"`
	FileMode *uint32 `json:"fileMode"`
	UID      *uint32 `json:"uid"`
	GID      *uint32 `json:"gid"`
}

type mountRecord struct {
	Source      string   `json:"source"`
	Destination string   `json:"destination"`
	Type        string   `json:"type"`
	Options     []string `json:"options"`
}

type hookRecord struct {
	Stage string   `json:"stage"`
	Path  string   `json:"path"`
	Args  []string `json:"args"`
}

type recordEvent struct {
	Event    string `json:"event"`
	At       string `json:"at"`
	ExitCode *int32 `json:"exitCode,omitempty"`
}

func timestamp(t time.Time) string {
	return t.UTC().Format(time.RFC3339Nano)
}

func nonNil(s []string) []string {
	if s == nil {
		return []string{}
	}
	return s
}

// fillFromSpec copies the CDI-relevant parts of an OCI spec into the record.
func (r *containerRecord) fillFromSpec(spec *oci.Spec) {
	r.DeviceNodes = []deviceNodeRecord{}
	r.Mounts = []mountRecord{}
	r.Hooks = []hookRecord{}
	r.Env = []string{}
	if spec == nil {
		return
	}
	if spec.Process != nil {
		r.Env = nonNil(append([]string(nil), spec.Process.Env...))
	}
	if spec.Linux != nil {
		for _, d := range spec.Linux.Devices {
			dn := deviceNodeRecord{Path: d.Path, Type: d.Type, Major: d.Major, Minor: d.Minor, UID: d.UID, GID: d.GID}
			if d.FileMode != nil {
				m := uint32(*d.FileMode)
				dn.FileMode = &m
			}
			r.DeviceNodes = append(r.DeviceNodes, dn)
		}
	}
	for _, m := range spec.Mounts {
		r.Mounts = append(r.Mounts, mountRecord{Source: m.Source, Destination: m.Destination, Type: m.Type, Options: nonNil(m.Options)})
	}
	if h := spec.Hooks; h != nil {
		add := func(stage string, hooks []oci.Hook) {
			for _, x := range hooks {
				r.Hooks = append(r.Hooks, hookRecord{Stage: stage, Path: x.Path, Args: nonNil(x.Args)})
			}
		}
		add("prestart", h.Prestart) //nolint:staticcheck // CDI may still emit prestart hooks.
		add("createRuntime", h.CreateRuntime)
		add("createContainer", h.CreateContainer)
		add("startContainer", h.StartContainer)
		add("poststart", h.Poststart)
		add("poststop", h.Poststop)
	}
}

// sanitize makes a name safe as one "_"-separated component of a file name.
func sanitize(s string, max int) string {
	var b strings.Builder
	for _, r := range s {
		switch {
		case r >= 'a' && r <= 'z', r >= 'A' && r <= 'Z', r >= '0' && r <= '9', r == '-', r == '.':
			b.WriteRune(r)
		default:
			b.WriteByte('-')
		}
	}
	out := strings.TrimLeft(b.String(), ".")
	if out == "" {
		out = "-"
	}
	if len(out) > max {
		out = out[:max]
	}
	return out
}

// recordFileName is <pod namespace>_<pod name>_<container name>_<container id>.json.
func recordFileName(r *containerRecord) string {
	return fmt.Sprintf("%s_%s_%s_%s.json",
		sanitize(r.PodNamespace, 63), sanitize(r.PodName, 63), sanitize(r.ContainerName, 63), sanitize(r.ContainerID, 64))
}

// writeRecord writes the record atomically (temporary file + rename) into dir.
func writeRecord(dir string, r *containerRecord) error {
	data, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	data = append(data, '\n')
	name := recordFileName(r)
	tmp, err := os.CreateTemp(dir, "."+name+".tmp-*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name()) // no-op after a successful rename
	if _, err := tmp.Write(data); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Chmod(0o644); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), filepath.Join(dir, name))
}
