//go:build tools

// The CNI plugins `make e2e` builds from this module for the pod network of the nodes that
// run a real runtime (e2e/README.md, "The pod network"): ``tap`` (the pod's eth0, a tap
// device made inside the pod's own network namespace: nothing is added to the host's; this
// VM's kernel has no dummy links), ``host-local`` (its address, from the node's own range,
// state in the node's directory) and ``loopback`` (the pod's lo). A module of its own, beside e2e/runtime: the plugins'
// dependency graph is theirs, and containerd's build is not moved by it. The file itself is
// never compiled.
package tools

import (
	_ "github.com/containernetworking/plugins/plugins/ipam/host-local"
	_ "github.com/containernetworking/plugins/plugins/main/loopback"
	_ "github.com/containernetworking/plugins/plugins/main/tap"
)
