//go:build tools

// Package tools pins the real container runtime used by the e2e tests:
// containerd 2.x (daemon, ctr, runc v2 shim) and the CNI plugins; runc is
// pinned in runc/ (see there). build.sh builds them from the Go module proxy;
// nothing imports this file.
package tools

import (
	_ "github.com/containerd/containerd/v2/cmd/containerd"
	_ "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2"
	_ "github.com/containerd/containerd/v2/cmd/ctr"
	_ "github.com/containernetworking/plugins/plugins/ipam/host-local"
	_ "github.com/containernetworking/plugins/plugins/main/bridge"
	_ "github.com/containernetworking/plugins/plugins/main/loopback"
)
