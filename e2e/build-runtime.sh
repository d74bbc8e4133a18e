#!/usr/bin/env bash
# Builds the real container runtime of the e2e nodes (gitignored e2e/bin-runtime/) from the
# module in e2e/runtime/: containerd (CRI plugin, CDI), its runc shim, ctr and runc, at the
# versions e2e/runtime/go.mod pins; then the CNI plugins of the nodes' pod network from the
# module in e2e/cni/ (tap, host-local, loopback, at the version e2e/cni/go.mod pins) into
# e2e/bin-runtime/cni/. One build serves every Kubernetes minor. Called by e2e/build.sh; one
# line per program with its time, as there.
#
# runc is built with `-tags seccomp` (cgo, Debian's libseccomp-dev): without it every pod
# sandbox the kubelet asks for fails "seccomp: config provided but seccomp not supported".
# containerd with `no_btrfs` (no btrfs headers needed; the nodes use the overlayfs or native
# snapshotter). The CNI plugins without cgo, as their project releases them.
#
# What it needs from Debian, installed here where missing (idempotent; `.ci/run` relies on it):
# libseccomp-dev (runc's seccomp) and busybox-static (the nodes' one image,
# tests/e2e/local_image.py).
set -euo pipefail
cd "$(dirname "$0")/runtime"
need=()
for pkg in libseccomp-dev busybox-static; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "e2e/build-runtime.sh: installing ${need[*]} (Debian packages)"
    apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}" >/dev/null
  else
    echo "e2e/build-runtime.sh: needs the Debian packages ${need[*]} (apt-get install ${need[*]})" >&2
    exit 1
  fi
fi
out=../bin-runtime
mkdir -p "$out"
go mod download
start=$(date +%s)
build() {  # build <tags> <package> <version module> [<out> <cgo>]
  local t v dir=${4:-$out} cgo=${5:-1}
  t=$(date +%s)
  v=$(go list -m -f '{{.Version}}' "$3")
  case $3 in
    */containerd/v2) ld="-X github.com/containerd/containerd/v2/version.Version=$v" ;;
    */containernetworking/plugins) ld="-X github.com/containernetworking/plugins/pkg/utils/buildversion.BuildVersion=$v" ;;
    *) ld="-X main.version=${v#v}" ;;
  esac
  CGO_ENABLED=$cgo go build -trimpath -tags "$1" -ldflags "-s -w $ld" -o "$dir/" "$2"
  echo "e2e/build-runtime.sh: e2e/${dir#../}/${2##*/} ($v) in $(( $(date +%s) - t )) s"
}
build seccomp github.com/opencontainers/runc github.com/opencontainers/runc
build no_btrfs github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2 github.com/containerd/containerd/v2
build no_btrfs github.com/containerd/containerd/v2/cmd/ctr github.com/containerd/containerd/v2
build no_btrfs github.com/containerd/containerd/v2/cmd/containerd github.com/containerd/containerd/v2
# the pod network's plugins (tests/e2e/real_runtime.py, NodeSpec.pod_network), their module
cd ../cni
go mod download
cni=../bin-runtime/cni
mkdir -p "$cni"
plugins=github.com/containernetworking/plugins
for p in main/tap ipam/host-local main/loopback; do
  build "" "$plugins/plugins/$p" "$plugins" "$cni" 0
done
echo "e2e/build-runtime.sh: built the runtime into e2e/bin-runtime in $(( $(date +%s) - start )) s"
