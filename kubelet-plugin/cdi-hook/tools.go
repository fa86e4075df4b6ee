//go:build tools

// Package tools pins NVIDIA's nvidia-cdi-hook, which the kubelet-plugin image ships (see
// build.sh and the Dockerfile's cdi-hook stage); nothing imports this file.
package tools

import _ "github.com/NVIDIA/nvidia-container-toolkit/cmd/nvidia-cdi-hook"
