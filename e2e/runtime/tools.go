//go:build tools

// The container runtime `make e2e` builds from this module for the nodes that run a real
// runtime (e2e/README.md, "A real container runtime"): containerd with its CRI plugin, its
// runc shim and ctr (image import), and runc. A module of its own, beside e2e/go.mod: its
// dependency graph (grpc, otel, containerd's own API) is containerd's, not Kubernetes', and
// one build serves both Kubernetes minors. The file itself is never compiled.
package tools

import (
	_ "github.com/containerd/containerd/v2/cmd/containerd"
	_ "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2"
	_ "github.com/containerd/containerd/v2/cmd/ctr"
	_ "github.com/opencontainers/runc"
)
