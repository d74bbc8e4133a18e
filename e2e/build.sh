#!/usr/bin/env bash
# Builds the e2e cluster's programs into e2e/bin (gitignored). Go's build cache makes a second
# run fast; `go mod download` fetches the modules on a fresh clone (the Go module proxy).
set -euo pipefail
cd "$(dirname "$0")"
command -v go >/dev/null || { echo "e2e/build.sh: needs Go >= 1.26 on PATH (https://go.dev/dl/)" >&2; exit 1; }
go mod download
K8S_VERSION=$(go list -m -f '{{.Version}}' k8s.io/kubernetes)
minor=${K8S_VERSION#v1.}; minor=${minor%%.*}
LDFLAGS="-s -w \
 -X k8s.io/component-base/version.gitVersion=${K8S_VERSION} \
 -X k8s.io/component-base/version.gitMajor=1 \
 -X k8s.io/component-base/version.gitMinor=${minor} \
 -X k8s.io/component-base/version.gitTreeState=clean \
 -X k8s.io/client-go/pkg/version.gitVersion=${K8S_VERSION}"
mkdir -p bin
start=$(date +%s)
go build -trimpath -ldflags "$LDFLAGS" -o bin/ \
  ./cmd/etcd ./cmd/crifake ./cmd/dracall \
  k8s.io/kubernetes/cmd/kube-apiserver \
  k8s.io/kubernetes/cmd/kube-scheduler \
  k8s.io/kubernetes/cmd/kube-controller-manager \
  k8s.io/kubernetes/cmd/kubelet
echo "e2e/build.sh: built $(ls bin | tr '\n' ' ')in $(( $(date +%s) - start )) s"
