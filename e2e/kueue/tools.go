//go:build tools

// Package kueue pins the Kueue controller manager the e2e suite runs, so that
// `go mod tidy` keeps its dependencies.
package kueue

import _ "sigs.k8s.io/kueue/cmd/kueue"
