#!/usr/bin/env bash
# Build the binaries of the e2e control plane from their Go modules, once per version.
#
#   e2e/toolchain/build.sh [component...]          (default: all components)
#   e2e/toolchain/build.sh --version COMPONENT     the version its wrapper pins (no Go needed)
#
# Components (components.tsv, next to this script): etcd kube-apiserver kube-controller-manager
# kube-scheduler kwok kuberay helm kubectl (a client matching the server's version); kubelet kube-proxy
# coredns (the group `node`: the real-node tier); kuberay-crds (only KubeRay's CRDs, from its Go
# module: seconds, not minutes). Each lands in
# ${HYBRIDFLOW_CACHE:-$HOME/.cache/hybridflow}/bin/<component>-<version>/<binary>; a binary already
# there is not rebuilt, so a warm run takes seconds. Versions come from the wrapper modules next to
# this script: kubernetes/ pins everything built against k8s.io v0.34, so the packages they share
# compile once; kwok/ pins kwok, whose release needs k8s.io v0.33.
# Builds run one after another: on small machines the linker's memory peak is what matters.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CACHE=${HYBRIDFLOW_CACHE:-$HOME/.cache/hybridflow}
BIN_ROOT=$CACHE/bin
COMPONENTS=$HERE/components.tsv

export CGO_ENABLED=0
# A fresh machine may have an older Go: let it fetch the toolchain a module asks for.
export GOTOOLCHAIN=${GOTOOLCHAIN:-auto}

usage() {
  sed -n '2,16p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
}

find_go() {
  if command -v go >/dev/null 2>&1; then
    command -v go
  elif [[ -x /usr/local/go/bin/go ]]; then
    echo /usr/local/go/bin/go
  else
    echo "build.sh: Go is not installed (need go on PATH or /usr/local/go/bin/go)" >&2
    exit 2
  fi
}

# module_version DIR MODULE: the version DIR/go.mod requires for MODULE.
module_version() {
  local version
  version=$(awk -v mod="$2" '
    $1 == "require" && $2 == mod { print $3; exit }
    $1 == mod && $2 ~ /^v/ { print $2; exit }' "$HERE/$1/go.mod")
  if [[ -z $version ]]; then
    echo "build.sh: $HERE/$1/go.mod does not require $2" >&2
    exit 2
  fi
  echo "$version"
}

# group NAME: the components of a group in components.tsv (control, node).
group() {
  awk -F'\t' -v g="$1" '!/^#/ && $7 == g { print $1 }' "$COMPONENTS"
}

# spec COMPONENT: prints "wrapper-dir module package binary cache" for a component (components.tsv).
spec() {
  local row
  row=$(awk -F'\t' -v c="$1" '!/^#/ && $1 == c { print $2, $3, $4, $5, $6; exit }' "$COMPONENTS")
  if [[ -z $row ]]; then
    echo "build.sh: unknown component '$1' (known: $(awk -F'\t' '!/^#/ { printf "%s ", $1 }' "$COMPONENTS")or the group 'node')" >&2
    exit 2
  fi
  echo "$row"
}

# component_version COMPONENT: the version its wrapper's go.mod pins.
component_version() {
  local row wrapper module rest
  row=$(spec "$1") || exit 2
  read -r wrapper module rest <<<"$row"
  module_version "$wrapper" "$module"
}

# ldflags COMPONENT VERSION: version stamps, so `--version` reports the real release.
ldflags() {
  local flags="-s -w"
  case $1 in
    kube-* | kubectl | kubelet)
      local major minor
      major=${2#v}; major=${major%%.*}
      minor=${2#v*.}; minor=${minor%%.*}
      for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
        flags+=" -X $pkg.gitVersion=$2 -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
        flags+=" -X $pkg.gitTreeState=clean"
      done
      ;;
    helm) flags+=" -X helm.sh/helm/v3/internal/version.version=$2" ;;
  esac
  echo "$flags"
}

# copy_kuberay_crds WRAPPER MODULE DEST: KubeRay's CRDs ship inside its Go module.
copy_kuberay_crds() {
  local src
  src=$(cd "$HERE/$1" && "$GO" list -m -f '{{.Dir}}' "$2")
  mkdir -p "$3"
  for crd in rayclusters rayjobs rayservices; do
    cp "$src/config/crd/bases/ray.io_$crd.yaml" "$3/"
    chmod u+w "$3/ray.io_$crd.yaml"
  done
}

# ensure_kuberay_crds VERSION: the CRDs alone, next to where the kuberay binary goes.
ensure_kuberay_crds() {
  local wrapper module cache
  read -r wrapper module _ _ cache <<<"$(spec kuberay-crds)"
  local dest=$BIN_ROOT/$cache-$1/crds
  if [[ -f $dest/ray.io_rayjobs.yaml ]]; then
    echo "kuberay-crds $1: present ($dest)"
    return
  fi
  local start=$SECONDS
  copy_kuberay_crds "$wrapper" "$module" "$dest.tmp"
  rm -rf "$dest" && mv "$dest.tmp" "$dest"
  echo "kuberay-crds $1: copied in $((SECONDS - start))s -> $dest"
}

build_one() {
  local component=$1 wrapper module pkg binary cache version dest
  read -r wrapper module pkg binary cache <<<"$(spec "$component")"
  version=$(module_version "$wrapper" "$module")
  if [[ $component == kuberay-crds ]]; then
    ensure_kuberay_crds "$version"
    return
  fi
  dest=$BIN_ROOT/$cache-$version
  if [[ -x $dest/$binary && ($component != kuberay || -f $dest/crds/ray.io_rayjobs.yaml) ]]; then
    echo "$component $version: present ($dest/$binary)"
    return
  fi
  local start=$SECONDS
  echo "$component $version: building $pkg ..."
  mkdir -p "$dest"
  # Build next to the destination and rename, so an interrupted build never looks complete.
  (cd "$HERE/$wrapper" && "$GO" build -trimpath -ldflags "$(ldflags "$component" "$version")" \
    -o "$dest/.$binary.tmp" "$pkg")
  mv -f "$dest/.$binary.tmp" "$dest/$binary"
  echo "$component $version: built in $((SECONDS - start))s -> $dest/$binary"
  if [[ $component == kuberay ]]; then
    ensure_kuberay_crds "$version"
  fi
}

main() {
  if [[ ${1:-} == -h || ${1:-} == --help ]]; then
    usage
    return
  fi
  if [[ ${1:-} == --version ]]; then
    [[ $# -eq 2 ]] || { echo "build.sh: --version takes one component" >&2; exit 2; }
    component_version "$2"
    return
  fi
  GO=$(find_go)
  local components=()
  for c in "$@"; do
    if [[ $c == node ]]; then mapfile -t -O "${#components[@]}" components < <(group node); else components+=("$c"); fi
  done
  [[ ${#components[@]} -gt 0 ]] || mapfile -t components < <(group control; group node)
  for c in "${components[@]}"; do spec "$c" >/dev/null; done
  mkdir -p "$BIN_ROOT"
  # Two test sessions must not build the same binary at once. A caller that took the lock for us passes
  # its descriptor (HYBRIDFLOW_BUILD_LOCK_FD): holding it open keeps the lock until this script exits.
  if [[ -z ${HYBRIDFLOW_BUILD_LOCK_FD:-} ]] && command -v flock >/dev/null 2>&1; then
    exec 9>"$BIN_ROOT/.build.lock"
    flock 9
  fi
  local start=$SECONDS
  for c in "${components[@]}"; do build_one "$c"; done
  echo "build.sh: ${#components[@]} component(s) ready in $((SECONDS - start))s under $BIN_ROOT"
}

main "$@"
