#!/usr/bin/env bash
# `make e2e-kind`: the cluster suite (e2e/test_cluster_e2e.py) against a kind cluster.
#
# Only the bootstrap differs from `make e2e`: create the cluster (e2e/kind/cluster.yaml) and turn its
# workers into fake GPU nodes, install KubeRay with its Helm chart, build the operator image and
# `kind load` it, install our chart, then run the suite with HYBRIDFLOW_E2E_KUBECONFIG so that it uses
# this cluster and the operator running in it.
#
# Needs Docker, kind, kubectl, helm and internet access (kind's node image, KubeRay's chart and image,
# the operator image's base). Not run in CI: the CI machines have no Docker.
#
# Environment:
#   KIND_CLUSTER_NAME  cluster name (default hybridflow-e2e); an existing cluster of that name is reused
#   KIND_NODE_IMAGE    node image, e.g. kindest/node:v1.34.0 (default: kind's); the chart needs >= 1.29
#   KEEP_CLUSTER=1     keep a cluster this script created (default: delete it at the end)
#   KUBERAY_VERSION    KubeRay chart version (default: the one `e2e/toolchain/build.sh --version kuberay` gives)
#   PYTHON             interpreter with hybridflow and pytest (default .venv/bin/python)
#   PYTEST_ARGS        extra arguments for pytest
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CLUSTER="${KIND_CLUSTER_NAME:-hybridflow-e2e}"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
KUBERAY_VERSION="${KUBERAY_VERSION:-$(bash "$ROOT/e2e/toolchain/build.sh" --version kuberay 2>/dev/null | sed 's/^v//')}"
RELEASE=hybridflow
RELEASE_NAMESPACE=hybridflow-system
IMAGE_REPOSITORY=docker.io/hybridflow/operator
IMAGE_TAG=e2e
STATE_DIR="${HYBRIDFLOW_CACHE:-$HOME/.cache/hybridflow}/kind"
WAIT=300s
GPUS_PER_NODE=8

log() { printf '\n==> %s\n' "$*" >&2; }
die() { printf 'e2e-kind: %s\n' "$*" >&2; exit 1; }

for tool in docker kind kubectl helm; do
  command -v "$tool" >/dev/null || die "$tool not found on PATH (make e2e-kind needs docker, kind, kubectl and helm)"
done
docker info >/dev/null 2>&1 || die "the Docker daemon is not reachable (docker info failed)"
[ -x "$PYTHON" ] || die "$PYTHON not found: run 'make venv' first, or set PYTHON"
[ -n "$KUBERAY_VERSION" ] || die "cannot read the KubeRay version (e2e/toolchain/build.sh --version kuberay): set KUBERAY_VERSION"

mkdir -p "$STATE_DIR"
export KUBECONFIG="$STATE_DIR/$CLUSTER.kubeconfig"  # every kubectl and helm below talks to this cluster only

created=0
cleanup() {
  if [ "$created" = 1 ] && [ "${KEEP_CLUSTER:-0}" != 1 ]; then
    log "deleting kind cluster $CLUSTER (KEEP_CLUSTER=1 keeps it)"
    kind delete cluster --name "$CLUSTER" || true
  fi
}
trap cleanup EXIT

# -- the cluster -----------------------------------------------------------------------------------------
if kind get clusters 2>/dev/null | grep -qx "$CLUSTER"; then
  log "reusing kind cluster $CLUSTER"
  kind export kubeconfig --name "$CLUSTER" --kubeconfig "$KUBECONFIG"
else
  log "creating kind cluster $CLUSTER"
  created=1
  kind create cluster --name "$CLUSTER" --config "$ROOT/e2e/kind/cluster.yaml" --kubeconfig "$KUBECONFIG" \
    --wait "$WAIT" ${KIND_NODE_IMAGE:+--image "$KIND_NODE_IMAGE"}
fi

# kind has no GPUs. Give the workers what GPU feature discovery and the NVIDIA device plugin would:
# product labels, the nvidia.com/gpu taint and nvidia.com/gpu in status.capacity/allocatable (the
# "advertise extended resources for a node" recipe: a status patch, kept by the kubelet until it
# re-registers the node). The scheduler then treats them as GPU nodes; nothing runs on a GPU.
fake_gpus() {
  local pool=$1 product=$2 node
  for node in $(kubectl get nodes -l "hybridflow.io/e2e-pool=$pool" -o jsonpath='{.items[*].metadata.name}'); do
    kubectl label node "$node" --overwrite nvidia.com/gpu.present=true "nvidia.com/gpu.product=$product" \
      "nvidia.com/gpu.count=$GPUS_PER_NODE" node-role.kubernetes.io/gpu=
    kubectl taint node "$node" nvidia.com/gpu=present:NoSchedule --overwrite
    kubectl patch node "$node" --subresource=status --type=json -p "[
      {\"op\": \"add\", \"path\": \"/status/capacity/nvidia.com~1gpu\", \"value\": \"$GPUS_PER_NODE\"},
      {\"op\": \"add\", \"path\": \"/status/allocatable/nvidia.com~1gpu\", \"value\": \"$GPUS_PER_NODE\"}]"
  done
}
log "turning the workers into fake GPU nodes"
fake_gpus a100 NVIDIA-A100-SXM4-80GB
fake_gpus h100 NVIDIA-H100-80GB-HBM3
gpu_nodes=$(kubectl get nodes -l nvidia.com/gpu.present=true -o name | wc -l)
[ "$gpu_nodes" -ge 5 ] || die "expected 5 fake GPU nodes (3 a100, 2 h100 in e2e/kind/cluster.yaml), found $gpu_nodes"
for _ in $(seq 60); do
  advertised=$(kubectl get nodes -l nvidia.com/gpu.present=true \
    -o jsonpath='{range .items[*]}{.status.allocatable.nvidia\.com/gpu}{"\n"}{end}' | grep -cx "$GPUS_PER_NODE" || true)
  [ "$advertised" -eq "$gpu_nodes" ] && break
  sleep 2
done
[ "$advertised" -eq "$gpu_nodes" ] || die "only $advertised of $gpu_nodes nodes advertise $GPUS_PER_NODE nvidia.com/gpu after 120 s"

# -- KubeRay, from its Helm chart ------------------------------------------------------------------------
log "installing KubeRay $KUBERAY_VERSION with its Helm chart"
helm repo add kuberay https://ray-project.github.io/kuberay-helm/ --force-update >/dev/null
helm repo update kuberay >/dev/null
helm upgrade --install kuberay-operator kuberay/kuberay-operator --version "$KUBERAY_VERSION" \
  --namespace kuberay-system --create-namespace --wait --timeout "$WAIT"

# -- the operator image, loaded into the nodes -----------------------------------------------------------
log "building $IMAGE_REPOSITORY:$IMAGE_TAG and loading it into the kind nodes"
docker build -f "$ROOT/docker/operator.Dockerfile" -t "$IMAGE_REPOSITORY:$IMAGE_TAG" "$ROOT"
kind load docker-image "$IMAGE_REPOSITORY:$IMAGE_TAG" --name "$CLUSTER"
image_id=$(docker image inspect -f '{{.Id}}' "$IMAGE_REPOSITORY:$IMAGE_TAG" | cut -d: -f2 | cut -c1-12)

# -- our chart -------------------------------------------------------------------------------------------
# pullPolicy Never: the image exists only in the nodes. The image-id annotation rolls the operator
# when a reused cluster gets a rebuilt image under the same tag.
log "installing charts/hybridflow as release $RELEASE in $RELEASE_NAMESPACE"
helm upgrade --install "$RELEASE" "$ROOT/charts/hybridflow" --namespace "$RELEASE_NAMESPACE" --create-namespace \
  --set image.repository="$IMAGE_REPOSITORY" --set image.tag="$IMAGE_TAG" --set image.pullPolicy=Never \
  --set-string "podAnnotations.hybridflow\.io/image-id=$image_id" \
  --wait --timeout "$WAIT"

# -- the suite -------------------------------------------------------------------------------------------
log "running e2e/test_cluster_e2e.py against kind cluster $CLUSTER"
cd "$ROOT"
# shellcheck disable=SC2086  # PYTEST_ARGS is a list of arguments
HYBRIDFLOW_E2E_KUBECONFIG="$KUBECONFIG" HYBRIDFLOW_E2E_RELEASE="$RELEASE" \
  HYBRIDFLOW_E2E_RELEASE_NAMESPACE="$RELEASE_NAMESPACE" \
  "$PYTHON" -m pytest -q -ra e2e/test_cluster_e2e.py ${PYTEST_ARGS:-}
