#!/usr/bin/env bash
# Builds the e2e cluster's programs (gitignored). Go's build cache makes a second run fast;
# `go mod download` fetches the modules on a fresh clone (the Go module proxy).
#
# K8S_VERSION picks the Kubernetes minor: 1.36 (the default: go.mod, into bin/) or 1.37
# (go.1.37.mod and go.1.37.sum through `go build -modfile`, into bin-1.37/). One line per
# program as it is built, with its time: a cold build is minutes per program on 2 cores.
# Then the nodes' real container runtime (containerd and runc, e2e/runtime/go.mod) into
# bin-runtime/, one build for every minor (e2e/build-runtime.sh; needs libseccomp-dev).
set -euo pipefail
cd "$(dirname "$0")"
command -v go >/dev/null || { echo "e2e/build.sh: needs Go >= 1.26 on PATH (https://go.dev/dl/)" >&2; exit 1; }
K8S_VERSION=${K8S_VERSION:-1.36}
case $K8S_VERSION in
  1.36) modfile=go.mod bin=bin ;;
  *) modfile=go.$K8S_VERSION.mod bin=bin-$K8S_VERSION ;;
esac
[ -f "$modfile" ] || {
  echo "e2e/build.sh: K8S_VERSION=$K8S_VERSION: no e2e/$modfile (supported: 1.36, $(ls go.*.mod 2>/dev/null | sed 's/^go\.\(.*\)\.mod$/\1/' | tr '\n' ' '))" >&2
  exit 2
}
mf=(-modfile="$modfile")
echo "e2e/build.sh: K8S_VERSION=$K8S_VERSION: e2e/$modfile -> e2e/$bin/ (downloading modules)"
go mod download "${mf[@]}"
full=$(go list "${mf[@]}" -m -f '{{.Version}}' k8s.io/kubernetes)
minor=${full#v1.}; minor=${minor%%.*}
LDFLAGS="-s -w \
 -X k8s.io/component-base/version.gitVersion=${full} \
 -X k8s.io/component-base/version.gitMajor=1 \
 -X k8s.io/component-base/version.gitMinor=${minor} \
 -X k8s.io/component-base/version.gitTreeState=clean \
 -X k8s.io/client-go/pkg/version.gitVersion=${full}"
mkdir -p "$bin"
programs=(./cmd/etcd ./cmd/crifake ./cmd/dracall
  k8s.io/kubernetes/cmd/kube-apiserver
  k8s.io/kubernetes/cmd/kube-scheduler
  k8s.io/kubernetes/cmd/kube-controller-manager
  k8s.io/kubernetes/cmd/kubelet
  k8s.io/kubernetes/cmd/kubectl)
start=$(date +%s)
i=0
for p in "${programs[@]}"; do
  i=$((i + 1))
  t=$(date +%s)
  go build "${mf[@]}" -trimpath -ldflags "$LDFLAGS" -o "$bin/" "$p"
  echo "e2e/build.sh: [$i/${#programs[@]}] $bin/${p##*/} ($full) in $(( $(date +%s) - t )) s"
done
echo "e2e/build.sh: built ${#programs[@]} programs for Kubernetes $full into e2e/$bin in $(( $(date +%s) - start )) s"
./build-runtime.sh
./build-helm.sh
