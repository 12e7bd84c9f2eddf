#!/usr/bin/env bash
# Build the project's container images with buildah: no Docker engine, no daemon, no registry.
#
#   docker/build-images.sh                 every image (what `make images` runs)
#   docker/build-images.sh runtime-cpu     one image, and the bases it needs
#   docker/build-images.sh --list          image names and references, tab-separated
#   docker/build-images.sh --key NAME      the input key of an image, without building anything
#   docker/build-images.sh --archive NAME  where that image's archive is (or will be)
#
# Bases that no registry can give are made here: a Debian rootfs from debootstrap, imported as an
# image, and stand-ins for python:3.11-slim and rayproject/ray built on it (docker/base/). Each image
# has an input key: a hash of its Dockerfile, the files its COPY/ADD read, its build arguments and its
# bases' keys. Its docker-archive, $HYBRIDFLOW_CACHE/images/<name>-<key>.tar, is the build's product:
# when it exists the image is not rebuilt. pip downloads persist in buildah cache mounts, so a rebuild
# after a code change does not fetch torch again. All state (buildah storage, cache mounts, rootfs)
# lives under $HYBRIDFLOW_CACHE; nothing is written to /var/lib/containers. One build runs at a time
# (a lock): a second caller waits for the first.
#
# stdout: one tab-separated line per image: name, reference, archive, archive bytes, seconds, and
# `built` or `cached`. Progress and buildah's output go to stderr.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(dirname "$HERE")
CACHE=${HYBRIDFLOW_CACHE:-$HOME/.cache/hybridflow}
IMAGES_DIR=$CACHE/images
ROOTFS_DIR=$CACHE/rootfs
BUILDAH_DIR=$CACHE/buildah
# Bump to rebuild every image after a change to how this script builds them.
SCHEMA=1
KEY_LABEL=io.hybridflow.image-key
KEEP_ARCHIVES=${HYBRIDFLOW_KEEP_ARCHIVES:-2}

SUITE=bookworm
# Installed by debootstrap on top of minbase (python:slim has them too); the rootfs is keyed by these.
ROOTFS_PACKAGES=(ca-certificates)
# Empty: debootstrap's default mirror.
DEBIAN_MIRROR=${DEBIAN_MIRROR:-}
# RUN steps see the build host's CA bundle at Debian's path (pip and wget read it there), so downloads
# work behind a proxy that re-signs TLS. It is mounted, not copied: no image contains it. Empty: none.
BUILD_CA=${HYBRIDFLOW_BUILD_CA-/etc/ssl/certs/ca-certificates.crt}

ALL=(debian-minbase python-slim ray-cpu pause node-base operator runtime-cpu)

log() { echo "build-images: $*" >&2; }
die() { log "$*"; exit 1; }

# The default of `ARG NAME=value` in a Dockerfile: the versions have one source of truth.
arg_default() { sed -n "s/^ARG $2=//p" "$1" | head -n1; }

APP_VERSION=$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' "$REPO/charts/hybridflow/Chart.yaml")
RAY_VERSION=$(arg_default "$REPO/docker/runtime.Dockerfile" RAY_VERSION)
PYTHON_TAG=$(arg_default "$REPO/docker/runtime.Dockerfile" PYTHON_TAG)
PYTHON_VERSION=$(arg_default "$REPO/docker/operator.Dockerfile" PYTHON_VERSION)

ref_of() {
  case $1 in
    debian-minbase) echo "localhost/hybridflow/debian:$SUITE-minbase" ;;
    python-slim) echo "docker.io/library/python:$PYTHON_VERSION-slim" ;;
    ray-cpu) echo "docker.io/rayproject/ray:$RAY_VERSION-$PYTHON_TAG-cpu" ;;
    pause) echo "registry.k8s.io/pause:3.6" ;;
    node-base) echo "docker.io/hybridflow/node-base:$SUITE" ;;
    operator) echo "docker.io/hybridflow/operator:$APP_VERSION" ;;
    runtime-cpu) echo "docker.io/hybridflow/runtime:$APP_VERSION-cpu" ;;
    *) die "unknown image $1 (known: ${ALL[*]})" ;;
  esac
}

dockerfile_of() {
  case $1 in
    operator | runtime) echo "$REPO/docker/$1.Dockerfile" ;;
    runtime-cpu) echo "$REPO/docker/runtime.Dockerfile" ;;
    ray-cpu) echo "$REPO/docker/base/ray.Dockerfile" ;;
    *) echo "$REPO/docker/base/$1.Dockerfile" ;;
  esac
}

# The images an image is built FROM, built (or loaded) before it.
bases_of() {
  case $1 in
    python-slim | node-base) echo debian-minbase ;;
    ray-cpu | operator) echo python-slim ;;
    runtime-cpu) echo ray-cpu ;;
  esac
}

build_args_of() {
  case $1 in
    ray-cpu) echo "RAY_VERSION=$RAY_VERSION" ;;
    operator) echo "PYTHON_VERSION=$PYTHON_VERSION" ;;
    runtime-cpu) printf '%s\n' "RAY_VERSION=$RAY_VERSION" "PYTHON_TAG=$PYTHON_TAG" ACCELERATOR_TAG=cpu WITH_VLLM=0 ;;
  esac
}

# ---------------------------------------------------------------------------------------------- keys

sha() { sha256sum | cut -c1-16; }

rootfs_key() {
  printf '%s\n' "debootstrap --variant=minbase $SUITE" "${ROOTFS_PACKAGES[@]}" | sha
}

rootfs_tar() { echo "$ROOTFS_DIR/debian-$SUITE-minbase-$(rootfs_key).tar"; }

# The context paths a Dockerfile's COPY and ADD read (not those of COPY --from=<stage>).
copy_sources() {
  awk 'toupper($1) == "COPY" || toupper($1) == "ADD" {
         from = 0; n = 0
         for (i = 2; i <= NF; i++) { if ($i ~ /^--from=/) from = 1; else if ($i !~ /^--/) src[++n] = $i }
         if (!from) for (i = 1; i < n; i++) print src[i]
       }' "$1"
}

# Path and content hash of every file under the given context paths, minus what .dockerignore drops.
hash_files() {
  local context=$1; shift
  (
    cd "$context"
    for pattern in "$@"; do
      compgen -G "$pattern" || true
    done | sort -u | while read -r path; do
      find "$path" \( -name __pycache__ -o -name '*.egg-info' -o -name '*.pyc' \) -prune -o -type f -print
    done | LC_ALL=C sort | xargs -r -d '\n' sha256sum
  )
}

# Inputs of an image that are not context files of the repo.
extra_inputs() {
  case $1 in
    debian-minbase) echo "rootfs $(rootfs_key)" ;;
    pause) echo "busybox $(sha256sum </bin/busybox)" ;;
  esac
}

context_of() {
  case $1 in
    operator | runtime-cpu) echo "$REPO" ;;
    *) echo "$BUILDAH_DIR/context/$1" ;;
  esac
}

declare -A KEYS=()

# Sets KEYS[name]: the hash of everything the image is made from (its bases by their keys).
compute_key() {
  local name=$1 base dockerfile
  [[ -n ${KEYS[$name]:-} ]] && return
  dockerfile=$(dockerfile_of "$name")
  for base in $(bases_of "$name"); do compute_key "$base"; done
  KEYS[$name]=$(
    echo "schema $SCHEMA"
    echo "ref $(ref_of "$name")"
    echo "dockerfile"; cat "$dockerfile"
    build_args_of "$name" | sed 's/^/arg /'
    for base in $(bases_of "$name"); do echo "base $base ${KEYS[$base]}"; done
    extra_inputs "$name"
    if [[ $(context_of "$name") == "$REPO" ]]; then
      mapfile -t sources < <(copy_sources "$dockerfile")
      hash_files "$REPO" "${sources[@]}" .dockerignore
    fi
  )
  KEYS[$name]=$(sha <<<"${KEYS[$name]}")
}

archive_of() { compute_key "$1"; echo "$IMAGES_DIR/$1-${KEYS[$1]}.tar"; }

# ------------------------------------------------------------------------------------------- buildah

pick_driver() {
  if [[ -n ${HYBRIDFLOW_BUILDAH_DRIVER:-} ]]; then echo "$HYBRIDFLOW_BUILDAH_DRIVER"; return; fi
  if [[ -f $BUILDAH_DIR/driver ]]; then cat "$BUILDAH_DIR/driver"; return; fi
  local driver=vfs probe=$BUILDAH_DIR/probe container
  # overlay needs a kernel and a filesystem that allow overlay mounts here: try one.
  if container=$(buildah --root "$probe/root" --runroot "$probe/run" --storage-driver overlay from scratch 2>/dev/null) &&
     buildah --root "$probe/root" --runroot "$probe/run" --storage-driver overlay mount "$container" >/dev/null 2>&1; then
    driver=overlay
  fi
  buildah --root "$probe/root" --runroot "$probe/run" --storage-driver overlay rm --all >/dev/null 2>&1 || true
  rm -rf "$probe" 2>/dev/null || true
  echo "$driver" >"$BUILDAH_DIR/driver"
  echo "$driver"
}

setup_buildah() {
  mkdir -p "$BUILDAH_DIR/tmp" "$IMAGES_DIR" "$ROOTFS_DIR"
  DRIVER=$(pick_driver)
  # Short names (FROM python:3.11-slim) resolve to docker.io, as with Docker; nothing is pulled.
  cat >"$BUILDAH_DIR/registries.conf" <<'EOF'
unqualified-search-registries = ["docker.io"]
short-name-mode = "permissive"
EOF
  echo '{"default": [{"type": "insecureAcceptAnything"}]}' >"$BUILDAH_DIR/policy.json"
  export CONTAINERS_REGISTRIES_CONF=$BUILDAH_DIR/registries.conf
  # buildah keeps cache mounts (the wheelhouses) and large temporary copies under TMPDIR.
  export TMPDIR=$BUILDAH_DIR/tmp
  # One build at a time; any container in this storage is then a leftover of an interrupted build.
  exec 9>"$BUILDAH_DIR/lock"
  flock 9
  bah rm --all >/dev/null
}

bah() {
  buildah --root "$BUILDAH_DIR/$DRIVER/root" --runroot "$BUILDAH_DIR/$DRIVER/run" --storage-driver "$DRIVER" "$@"
}

# Images come from this storage and archives only: accept them unsigned, whatever the host's policy.
POLICY=(--signature-policy "$BUILDAH_DIR/policy.json")

# ----------------------------------------------------------------------------------------- contexts

make_rootfs() {
  local tar work
  tar=$(rootfs_tar)
  [[ -f $tar ]] && return
  log "debootstrap --variant=minbase $SUITE (${ROOTFS_PACKAGES[*]})"
  work=$(mktemp -d "$ROOTFS_DIR/work.XXXXXX")
  local packages
  packages=$(IFS=,; echo "${ROOTFS_PACKAGES[*]}")
  debootstrap --variant=minbase ${packages:+--include="$packages"} "$SUITE" "$work/root" $DEBIAN_MIRROR >&2
  # What a container runtime provides (devices, resolv.conf) and what apt re-downloads stays out.
  rm -rf "$work/root"/dev/* "$work/root"/var/lib/apt/lists/* "$work/root"/var/cache/apt/*.bin \
         "$work/root"/var/cache/apt/archives/*.deb "$work/root"/var/log/bootstrap.log
  : >"$work/root/etc/resolv.conf"
  tar --numeric-owner -C "$work/root" -cf "$work/rootfs.tar" .
  mv "$work/rootfs.tar" "$tar"
  rm -rf "$work"
}

prepare_context() {
  local name=$1 dir
  dir=$(context_of "$name")
  [[ $dir == "$REPO" ]] && return
  rm -rf "$dir" && mkdir -p "$dir"
  case $name in
    debian-minbase) make_rootfs && ln "$(rootfs_tar)" "$dir/rootfs.tar" ;;
    pause) cp /bin/busybox "$dir/busybox" ;;
  esac
}

# ------------------------------------------------------------------------------------------- builds

declare -A DONE=()

image_key_in_storage() {
  bah inspect --type image --format "{{index .OCIv1.Config.Labels \"$KEY_LABEL\"}}" "$1" 2>/dev/null || true
}

# A base must be in buildah's storage with the right key: from its archive when the storage lacks it.
load_base() {
  local name=$1 ref
  ref=$(ref_of "$name")
  [[ $(image_key_in_storage "$ref") == "${KEYS[$name]}" ]] && return
  log "loading $ref from $(archive_of "$name")"
  bah pull --quiet "${POLICY[@]}" "docker-archive:$(archive_of "$name")" >/dev/null
}

# Worktrees share the cache: an image's newest archives stay (one per checkout that builds it, say),
# older ones go. Runtime archives weigh gigabytes.
prune_archives() {
  ls -t "$IMAGES_DIR/$1"-*.tar | tail -n +$((KEEP_ARCHIVES + 1)) | xargs -r rm -f
}

report() {
  local name=$1 seconds=$2 state=$3 archive bytes
  archive=$(archive_of "$name")
  bytes=$(stat -c %s "$archive")
  log "$(printf '%-15s %-45s %8s  %4ss  %s' "$name" "$(ref_of "$name")" "$(numfmt --to=iec "$bytes")" "$seconds" "$state")"
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$(ref_of "$name")" "$archive" "$bytes" "$seconds" "$state"
}

build() {
  local name=$1 base archive ref dockerfile start args=()
  [[ -n ${DONE[$name]:-} ]] && return
  DONE[$name]=1
  compute_key "$name"
  archive=$(archive_of "$name")
  ref=$(ref_of "$name")
  if [[ -f $archive ]]; then
    report "$name" 0 cached
    return
  fi
  for base in $(bases_of "$name"); do build "$base"; load_base "$base"; done
  start=$(date +%s)
  prepare_context "$name"
  dockerfile=$(dockerfile_of "$name")
  while read -r arg; do [[ -n $arg ]] && args+=(--build-arg "$arg"); done < <(build_args_of "$name")
  [[ -n $BUILD_CA && -f $BUILD_CA ]] && args+=(--volume "$BUILD_CA:/etc/ssl/certs/ca-certificates.crt:ro")
  log "building $ref (key ${KEYS[$name]}, storage driver $DRIVER)"
  bah bud --layers --force-rm --pull-never --network host --format docker "${POLICY[@]}" \
    --label "$KEY_LABEL=${KEYS[$name]}" -t "$ref" -f "$dockerfile" "${args[@]}" "$(context_of "$name")" >&2
  rm -f "$archive.partial"
  bah push --quiet "${POLICY[@]}" "$ref" "docker-archive:$archive.partial:$ref" >&2
  mv "$archive.partial" "$archive"
  prune_archives "$name"
  report "$name" $(($(date +%s) - start)) built
}

need() {
  local missing=() cmd
  for cmd in "$@"; do command -v "$cmd" >/dev/null || missing+=("$cmd"); done
  [[ ${#missing[@]} -eq 0 ]] || die "missing ${missing[*]}: run e2e/toolchain/install-node-packages.sh as root"
}

main() {
  case ${1:-} in
    --list)
      for name in "${ALL[@]}"; do printf '%s\t%s\n' "$name" "$(ref_of "$name")"; done
      return ;;
    --key) compute_key "${2:?--key NAME}"; echo "${KEYS[$2]}"; return ;;
    --archive) archive_of "${2:?--archive NAME}"; return ;;
  esac
  local names=("$@")
  [[ ${#names[@]} -gt 0 ]] || names=("${ALL[@]}")
  for name in "${names[@]}"; do ref_of "$name" >/dev/null; done
  need buildah debootstrap flock sha256sum numfmt
  [[ $(id -u) -eq 0 ]] || die "buildah runs as root here (its storage and the rootfs need it)"
  setup_buildah
  for name in "${names[@]}"; do build "$name"; done
}

main "$@"
