//go:build tools

// Package tools pins go-containerregistry's crane, which registry.sh builds and uses both to
// serve a registry on loopback (`crane registry serve`) and to push the e2e images to it;
// nothing imports this file.
package tools

import _ "github.com/google/go-containerregistry/cmd/crane"
