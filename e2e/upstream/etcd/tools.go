//go:build tools

// Package etcd pins the etcd server this suite runs. It is a module of its own
// because etcd 3.6 and Kubernetes 1.37 require different etcd client versions.
package etcd

import _ "go.etcd.io/etcd/server/v3"
