#!/usr/bin/env bash
# Builds the Helm CLI of the e2e (gitignored e2e/bin-helm/helm) from the module in e2e/helm/,
# at the version e2e/helm/go.mod pins (helm.sh/helm/v4). It is the `helm` the README's
# install line names: test_chart_real.py runs `helm install` / `helm uninstall` with it
# against the e2e cluster. One build serves every Kubernetes minor. Called by e2e/build.sh
# after the runtime; one line with its time, as there.
#
# The version string is Helm's own: its Makefile sets internal/version.version (otherwise
# `helm version` says only "v4.3").
set -euo pipefail
cd "$(dirname "$0")/helm"
out=../bin-helm
mkdir -p "$out"
go mod download
start=$(date +%s)
v=$(go list -m -f '{{.Version}}' helm.sh/helm/v4)
go build -trimpath \
  -ldflags "-s -w -X helm.sh/helm/v4/internal/version.version=$v" \
  -o "$out/" helm.sh/helm/v4/cmd/helm
echo "e2e/build-helm.sh: e2e/bin-helm/helm ($v) in $(( $(date +%s) - start )) s"
