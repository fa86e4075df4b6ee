//go:build tools

// Package tools pins runc in a module of its own: containerd's dependency graph
// (hcsshim) requires a newer runc library, which would otherwise raise the runc
// binary past the pinned release. build.sh builds it from the Go module proxy;
// nothing imports this file.
package tools

import (
	_ "github.com/opencontainers/runc"
)
