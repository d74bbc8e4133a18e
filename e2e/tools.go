//go:build tools

// The Kubernetes programs `make e2e` builds from this module (go build k8s.io/kubernetes/cmd/...).
// Importing them here keeps their dependencies in go.mod and go.sum (go mod tidy reads every
// build tag); the file itself is never compiled.
package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubectl"
	_ "k8s.io/kubernetes/cmd/kubelet"
)
