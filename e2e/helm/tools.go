//go:build tools

// The Helm CLI `make e2e` builds from this module (e2e/README.md, "Helm"): the `helm` the
// README's install line runs, for test_chart_real.py. A module of its own, beside e2e/go.mod
// and e2e/runtime/go.mod: Helm v4's dependency graph (client-go v0.37, kustomize, oras,
// wazero for its plugins) is its own, and one build serves both Kubernetes minors (Helm's
// client talks to any API server within its skew). The file itself is never compiled.
package tools

import _ "helm.sh/helm/v4/cmd/helm"
