#!/usr/bin/env bash
# Prints the replace block e2e/go.mod needs: k8s.io/kubernetes replaces each of its staging
# modules with a directory of its own tree; a module that depends on it must pin each of them
# to the published version instead. Usage: hack/replaces.sh v1.36.3 > block; paste into go.mod.
set -euo pipefail
ver=${1:-v1.36.3}
staging=v0.${ver#v1.}
mod=$(go mod download -json "k8s.io/kubernetes@$ver" | sed -n 's/.*"GoMod": "\(.*\)",*/\1/p')
echo "replace ("
sed -n '/^replace (/,/^)/p' "$mod" | awk -v v="$staging" '/=>/ {print "\t" $1 " => " $1 " " v}'
echo ")"
