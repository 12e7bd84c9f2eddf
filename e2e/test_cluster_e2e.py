"""End to end on a cluster: our Helm chart, the operator under the chart's identity, the real KubeRay
operator and kube-scheduler, GPU nodes (fake ones).

One suite, two ways to get the cluster:

- default: the local control plane of e2e/harness (`full_cluster`: kube-controller-manager,
  kube-scheduler, kwok nodes, KubeRay out of cluster). The chart is installed with helm. Its operator
  pod is scheduled but kwok runs nothing, so the operator runs here as a local process with the
  command, arguments and environment of the Deployment the chart installed, and a token of the chart's
  ServiceAccount from the TokenRequest API: the chart's RBAC is all it has.
- HYBRIDFLOW_E2E_KUBECONFIG: an existing cluster where the chart is already installed and the operator
  runs in-cluster from its image (e2e/kind/run.sh builds such a cluster with kind).

Either way every test fails when the operator logged a 403 while it ran: a permission missing from the
chart fails the suite. Where each path ends without a live Ray is in e2e/README.md.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import pytest
import yaml

from e2e.harness import chart
from e2e.harness.controlplane import ControlPlane, KubectlClient, KubectlError, eventually
from e2e.harness.operator import OperatorProcess
from hybridflow.api import API_GROUP
from hybridflow.k8s import names
from hybridflow_operator.settings import OperatorSettings, from_env
from tests.helpers import condition, reward_pool_graph, unavailable, without_pod_storage

pytestmark = pytest.mark.controlplane

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "ppo-job.yaml"
CRD_NAME = chart.CRD_NAME

EXTERNAL_KUBECONFIG = os.environ.get("HYBRIDFLOW_E2E_KUBECONFIG", "")
RELEASE = os.environ.get("HYBRIDFLOW_E2E_RELEASE", "hybridflow")
RELEASE_NAMESPACE = os.environ.get("HYBRIDFLOW_E2E_RELEASE_NAMESPACE", "hybridflow-system")

WAIT_S = 120.0  # generous: the development machines are 2 shared cores
START_S = 60.0
TOKEN_DURATION = "4h"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
GPU = "nvidia.com/gpu"
# The API server's 403s as our client and kopf report them, and kopf's words when it may not list/watch
# (not a bare 403: log timestamps end in milliseconds).
FORBIDDEN = re.compile(r"forbidden|error 403\b|\(403\)|not enough (rbac )?permissions", re.IGNORECASE)

T = TypeVar("T")


# -- the cluster ------------------------------------------------------------------------------------------


@dataclass
class ExistingCluster(KubectlClient):
    """A cluster someone else made (kind), reached through its kubeconfig."""

    kubeconfig: Path

    def create_namespace(self, name: str) -> None:
        """Create a namespace and wait until Pods may be created in it (its default ServiceAccount)."""
        self.kubectl("create", "namespace", name)
        eventually(
            lambda: self.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode == 0,
            START_S,
            f"serviceaccount {name}/default (created by the controller-manager)",
        )


def cpu_cores(quantity: str) -> float:
    """A CPU quantity (`96`, `7800m`) in cores."""
    return float(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
_DECIMAL = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def memory_bytes(quantity: str) -> float:
    """A memory quantity (`1152Gi`, `16331464Ki`, `64G`) in bytes."""
    for units in (_BINARY, _DECIMAL):
        for suffix, factor in units.items():
            if quantity.endswith(suffix):
                return float(quantity[: -len(suffix)]) * factor
    return float(quantity)


@dataclass(frozen=True)
class Fleet:
    """The schedulable nodes, by GPU product, as the tests need to know them."""

    labels: dict[str, dict[str, str]]
    by_product: dict[str, list[str]]
    cpu_nodes: list[str]
    allocatable: dict[str, dict[str, str]]

    @classmethod
    def discover(cls, kube: KubectlClient) -> Fleet:
        labels: dict[str, dict[str, str]] = {}
        by_product: dict[str, list[str]] = {}
        cpu_nodes: list[str] = []
        allocatable: dict[str, dict[str, str]] = {}
        for node in kube.get_json("nodes")["items"]:
            name = node["metadata"]["name"]
            node_labels = node["metadata"].get("labels") or {}
            labels[name] = node_labels
            allocatable[name] = (node.get("status") or {}).get("allocatable") or {}
            taints = [t for t in (node.get("spec") or {}).get("taints") or [] if t.get("key") != GPU]
            if (node.get("spec") or {}).get("unschedulable") or any(
                t.get("effect") in ("NoSchedule", "NoExecute") for t in taints
            ):
                continue  # the control plane of a kind cluster, cordoned nodes
            product = node_labels.get(GPU_PRODUCT_LABEL)
            if product and int(allocatable[name].get(GPU, "0")) > 0:
                by_product.setdefault(product, []).append(name)
            elif not product:
                cpu_nodes.append(name)
        return cls(labels, by_product, sorted(cpu_nodes), allocatable)

    def nodes_of(self, products: tuple[str, ...]) -> list[str]:
        return sorted(n for p in products for n in self.by_product.get(p, []))

    def require(self, what: str, products: tuple[str, ...], gpu_nodes: int, cpu_nodes: int = 1) -> None:
        """Fail with what this test needs when the cluster is smaller (kind clusters are made by hand)."""
        found = self.nodes_of(products)
        if len(found) < gpu_nodes or len(self.cpu_nodes) < cpu_nodes:
            pytest.fail(
                f"{what} needs {gpu_nodes} schedulable nodes labelled {GPU_PRODUCT_LABEL} in {list(products)} "
                f"with 8 allocatable {GPU} and {cpu_nodes} node(s) without GPUs; the cluster has "
                f"{len(found)} and {len(self.cpu_nodes)} ({self.by_product}, cpu: {self.cpu_nodes}); "
                "see the kind section of e2e/README.md",
                pytrace=False,
            )

    def fits(self, node: str, cpus: float, memory: str) -> bool:
        free = self.allocatable.get(node, {})
        return cpu_cores(free.get("cpu", "0")) >= cpus and memory_bytes(free.get("memory", "0")) >= memory_bytes(memory)


# -- the operator -----------------------------------------------------------------------------------------


def release_deployment(kube: KubectlClient) -> dict[str, Any]:
    """The operator Deployment our chart installed for RELEASE (found by the chart's labels)."""
    selector = f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/name=hybridflow"
    found = kube.get_json("deployments", "-n", RELEASE_NAMESPACE, "-l", selector)["items"]
    if len(found) != 1:
        raise AssertionError(
            f"expected one Deployment labelled {selector} in {RELEASE_NAMESPACE}, found {len(found)}: "
            "is the chart installed (helm install {RELEASE} charts/hybridflow -n {RELEASE_NAMESPACE})?"
        )
    return found[0]


def operator_container(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "operator"]
    return container


def container_env(container: dict[str, Any], namespace: str) -> dict[str, str]:
    """The container's environment as the kubelet would set it (fieldRef metadata.namespace resolved)."""
    env: dict[str, str] = {}
    for var in container.get("env") or []:
        source = var.get("valueFrom")
        if source is None:
            env[var["name"]] = var.get("value", "")
        elif (source.get("fieldRef") or {}).get("fieldPath") == "metadata.namespace":
            env[var["name"]] = namespace
        else:
            raise AssertionError(f"the chart sets {var['name']} from {source}: teach the e2e suite to resolve it")
    return env


class Operator(Protocol):
    """The running operator, wherever it runs."""

    user: str
    settings: OperatorSettings

    def log(self) -> str: ...

    def describe(self) -> str: ...


class LocalOperator(OperatorProcess):
    """`python -m hybridflow_operator` on this machine, as the chart's Deployment would run it.

    Command, arguments and environment come from the installed Deployment; the credentials are a
    kubeconfig holding a token of the Deployment's ServiceAccount and nothing else.
    """

    def __init__(self, kube: ControlPlane, deployment: dict[str, Any], work_dir: Path) -> None:
        self.kube = kube
        self.kubeconfig = work_dir / "operator.kubeconfig"
        pod = deployment["spec"]["template"]["spec"]
        self.service_account = pod.get("serviceAccountName") or "default"
        self.user = f"system:serviceaccount:{RELEASE_NAMESPACE}:{self.service_account}"
        self.container = operator_container(deployment)
        container_vars = container_env(self.container, RELEASE_NAMESPACE)
        self.settings = from_env(container_vars)
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("HYBRIDFLOW_", "KUBERNETES_SERVICE_")) and k != "KUBECONFIG"
        }
        env |= container_vars | {"KUBECONFIG": str(self.kubeconfig), "PYTHONUNBUFFERED": "1"}
        super().__init__(work_dir / "operator.log", env, cwd=work_dir)
        self.argv()  # the chart's command must be one this suite can run: fail now, not at start

    def argv(self) -> list[str]:
        command = list(self.container.get("command") or [])
        if not command or not Path(command[0]).name.startswith("python"):
            raise AssertionError(f"the chart's operator command {command} is not `python ...`: cannot run it here")
        args = list(self.container.get("args") or [])
        if "--liveness" in args:
            raise AssertionError("the chart passes `--liveness VALUE`; the e2e suite expects `--liveness=VALUE`")
        # Same flags, but the liveness endpoint on a free loopback port instead of 0.0.0.0:8080.
        args = [a for a in args if not a.startswith("--liveness=")] + [f"--liveness={self.liveness}"]
        return [sys.executable, *command[1:], *args]

    def write_kubeconfig(self) -> None:
        """A kubeconfig with the API server's address and CA, and a ServiceAccount token (TokenRequest)."""
        token = self.kube.kubectl(
            "create", "token", self.service_account, "-n", RELEASE_NAMESPACE, f"--duration={TOKEN_DURATION}"
        ).stdout.strip()
        admin = yaml.safe_load(self.kube.kubeconfig.read_text())
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": admin["clusters"],
            "users": [{"name": self.service_account, "user": {"token": token}}],
            "contexts": [
                {
                    "name": "operator",
                    "context": {"cluster": admin["clusters"][0]["name"], "user": self.service_account},
                }
            ],
            "current-context": "operator",
        }
        self.kubeconfig.write_text(yaml.safe_dump(config, sort_keys=False))
        self.kubeconfig.chmod(0o600)

    def start(self, timeout: float = START_S) -> None:
        self.write_kubeconfig()
        super().start(timeout)

    def describe(self) -> str:
        return f"local operator as {self.user}, {super().describe()}"


class InClusterOperator:
    """The chart's Deployment running the operator image (kind)."""

    def __init__(self, kube: KubectlClient, deployment: dict[str, Any]) -> None:
        self.kube = kube
        self.name = deployment["metadata"]["name"]
        pod = deployment["spec"]["template"]["spec"]
        self.user = f"system:serviceaccount:{RELEASE_NAMESPACE}:{pod.get('serviceAccountName') or 'default'}"
        self.settings = from_env(container_env(operator_container(deployment), RELEASE_NAMESPACE))

    def wait_available(self) -> None:
        self.kube.kubectl(
            "rollout",
            "status",
            f"deployment/{self.name}",
            "-n",
            RELEASE_NAMESPACE,
            f"--timeout={int(WAIT_S)}s",
            timeout=WAIT_S + 10,
        )

    def log(self) -> str:
        """The operator pod's log; an error when it cannot be read (the 403 check must not go blind)."""
        return self.kube.kubectl("logs", f"deployment/{self.name}", "-n", RELEASE_NAMESPACE).stdout

    def describe(self) -> str:
        try:
            lines = self.log().splitlines()[-40:]
        except KubectlError as e:
            lines = [f"(log unavailable: {e})"]
        return f"in-cluster operator deployment/{self.name} as {self.user}; log tail:\n" + "\n".join(lines)


# -- fixtures ---------------------------------------------------------------------------------------------


@dataclass
class E2E:
    """The cluster, the operator and what the tests need to know about both."""

    kube: KubectlClient
    operator: Operator
    fleet: Fleet
    pods_run: bool
    """kwok turns a bound pod Running and Ready; a real cluster would need the runtime image."""
    create_namespace: Callable[[str], None]
    log_mark: int = 0
    """Offset in the operator's log up to which 403s are accounted for."""

    @property
    def shrink(self) -> bool:
        """Whether the example's pods are too big for this cluster's A100 nodes (kind): one node must
        hold an actor pod (64 CPUs, 800Gi) and the co-location test's two reward pods (16, 64Gi each)."""
        a100 = self.fleet.nodes_of(self.products("A100-80GB"))
        return not a100 or not all(self.fleet.fits(n, 64 + 2 * 16, "928Gi") for n in a100)

    def products(self, gpu_type: str) -> tuple[str, ...]:
        return tuple(self.operator.settings.render.gpu_products.get(gpu_type, ()))

    def forbidden_since_mark(self) -> list[str]:
        return [line for line in self.operator.log()[self.log_mark :].splitlines() if FORBIDDEN.search(line)]


def _require_helm() -> None:
    if chart.helm_binary() is None:
        unavailable("helm not found: run `bash e2e/toolchain/build.sh helm` (needs Go) or put helm on PATH")


def helm(kube: KubectlClient, *args: str) -> str:
    _require_helm()
    return chart.helm(kube, *args)


def install_chart(cp: ControlPlane) -> None:
    _require_helm()
    chart.install_chart(cp, RELEASE, RELEASE_NAMESPACE, timeout=WAIT_S)


if EXTERNAL_KUBECONFIG:

    @pytest.fixture(scope="module")
    def e2e() -> Iterator[E2E]:
        """An existing cluster with the chart installed (e2e/kind/run.sh)."""
        kube = ExistingCluster(Path(EXTERNAL_KUBECONFIG))
        operator = InClusterOperator(kube, release_deployment(kube))
        operator.wait_available()
        yield E2E(kube, operator, Fleet.discover(kube), pods_run=False, create_namespace=kube.create_namespace)

else:

    @pytest.fixture(scope="module")
    def e2e(full_cluster: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2E]:
        """The local control plane with the chart installed and the operator running under its identity."""
        install_chart(full_cluster)
        operator = LocalOperator(full_cluster, release_deployment(full_cluster), tmp_path_factory.mktemp("operator"))
        try:
            operator.start()
            yield E2E(
                full_cluster,
                operator,
                Fleet.discover(full_cluster),
                pods_run=True,
                create_namespace=full_cluster.create_namespace,
            )
        finally:
            operator.stop()
            helm(full_cluster, "uninstall", RELEASE, "--namespace", RELEASE_NAMESPACE, "--wait")


@pytest.fixture(autouse=True)
def no_forbidden_requests(e2e: E2E) -> Iterator[None]:
    """Fail the test during which the operator was refused anything (its start counts towards the
    first test): the chart's RBAC is incomplete. Each refusal fails one test, not every later one."""
    yield
    refused = e2e.forbidden_since_mark()
    e2e.log_mark = len(e2e.operator.log())
    assert not refused, "the operator was refused by the API server (add the permission to the chart's RBAC):\n" + (
        "\n".join(refused[:10])
    )


@pytest.fixture
def ns(e2e: E2E) -> Iterator[str]:
    """A fresh namespace; afterwards its jobs are deleted and their pods waited out, freeing the GPUs."""
    name = f"e2e-{uuid.uuid4().hex[:8]}"
    e2e.create_namespace(name)
    yield name
    e2e.kube.kubectl("delete", "rltrainingjobs", "--all", "-n", name, "--wait=true", "--timeout=60s", timeout=90)
    eventually(lambda: not ray_pods(e2e, name, terminating=True), WAIT_S, f"the Ray pods in {name} are gone")
    e2e.kube.kubectl("delete", "namespace", name, "--wait=false", check=False)


# -- helpers ----------------------------------------------------------------------------------------------


def example_job(e2e: E2E, namespace: str, name: str | None = None) -> dict[str, Any]:
    """examples/ppo-job.yaml in `namespace`; with small requests where the nodes are small (kind)."""
    doc = without_pod_storage(yaml.safe_load(EXAMPLE.read_text()))
    doc["metadata"]["namespace"] = namespace
    if name:
        doc["metadata"]["name"] = name
    if e2e.shrink:
        cluster = doc["spec"]["cluster"]
        cluster |= {"headCpus": 1, "headMemory": "512Mi", "shmSize": "256Mi"}
        for group in cluster["workerGroups"]:
            group |= {"cpusPerWorker": 1, "memory": "512Mi"}
    return doc


def apply(e2e: E2E, doc: dict[str, Any]) -> str:
    e2e.kube.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
    return str(doc["metadata"]["name"])


def get(e2e: E2E, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
    result = e2e.kube.kubectl("get", kind, name, "-n", namespace, "-o", "json", check=False)
    return json.loads(result.stdout) if result.returncode == 0 else None


def job_of(e2e: E2E, namespace: str, name: str) -> dict[str, Any]:
    job = get(e2e, "rltrainingjob", namespace, name)
    assert job is not None, f"RLTrainingJob {namespace}/{name} is gone"
    return job


def ray_pods(e2e: E2E, namespace: str, job: str | None = None, terminating: bool = False) -> list[dict[str, Any]]:
    """Head and worker pods (not KubeRay's submitter) of one job, or of every job in the namespace;
    pods being deleted only when `terminating` (they still hold their node's GPUs)."""
    selector = f"{names.JOB_LABEL}={job}" if job else names.JOB_LABEL
    pods = e2e.kube.get_json("pods", "-n", namespace, "-l", f"{selector},ray.io/node-type")["items"]
    return [p for p in pods if terminating or not p["metadata"].get("deletionTimestamp")]


def pod_summary(pods: list[dict[str, Any]]) -> str:
    rows = []
    for pod in pods:
        scheduled = next((c for c in pod["status"].get("conditions") or [] if c["type"] == "PodScheduled"), {})
        rows.append(
            f"  {pod['metadata']['name']}: node={pod['spec'].get('nodeName')} phase={pod['status'].get('phase')} "
            f"scheduled={scheduled.get('status')}/{scheduled.get('reason')} {scheduled.get('message', '')}"
        )
    return "\n".join(rows) or "  (none)"


def wait_for(e2e: E2E, namespace: str, job: str, check: Callable[[], T | None], what: str) -> T:
    """eventually(), failing with the job's status, its pods and the operator's log."""
    try:
        return eventually(check, WAIT_S, what)
    except AssertionError as e:
        found = get(e2e, "rltrainingjob", namespace, job)
        status = json.dumps((found or {}).get("status"), indent=1)
        pods = pod_summary(e2e.kube.get_json("pods", "-n", namespace)["items"])
        raise AssertionError(f"{e}\njob status: {status}\npods:\n{pods}\n{e2e.operator.describe()}") from None


def wait_job(e2e: E2E, namespace: str, job: str, check: Callable[[dict[str, Any]], bool], what: str) -> dict[str, Any]:
    def ready() -> dict[str, Any] | None:
        found = job_of(e2e, namespace, job)
        return found if check(found) else None

    return wait_for(e2e, namespace, job, ready, f"RLTrainingJob {namespace}/{job}: {what}")


def wait_bound(e2e: E2E, namespace: str, job: str, count: int) -> dict[str, list[dict[str, Any]]]:
    """Wait until the job has `count` Ray pods, all bound to nodes; returns them by Ray group (head too)."""

    def bound() -> dict[str, list[dict[str, Any]]] | None:
        pods = ray_pods(e2e, namespace, job)
        if len(pods) != count or not all(p["spec"].get("nodeName") for p in pods):
            return None
        groups: dict[str, list[dict[str, Any]]] = {}
        for pod in pods:
            labels = pod["metadata"]["labels"]
            key = "head" if labels.get("ray.io/node-type") == "head" else labels.get("ray.io/group", "?")
            groups.setdefault(key, []).append(pod)
        return groups

    return wait_for(e2e, namespace, job, bound, f"{count} Ray pods of {job} bound to nodes")


def product_of(e2e: E2E, pod: dict[str, Any]) -> str | None:
    return e2e.fleet.labels.get(pod["spec"]["nodeName"], {}).get(GPU_PRODUCT_LABEL)


def rayjob_of(e2e: E2E, namespace: str, job: str) -> dict[str, Any]:
    rayjob = names.rayjob_name(job)
    return wait_for(e2e, namespace, job, lambda: get(e2e, "rayjob", namespace, rayjob), f"RayJob {rayjob}")


def set_suspend(e2e: E2E, namespace: str, job: str, suspend: bool) -> None:
    patch = {"spec": {"runPolicy": {"suspend": suspend}}}
    e2e.kube.kubectl("patch", "rltrainingjob", job, "-n", namespace, "--type=merge", "-p", json.dumps(patch))


def controller_of(obj: dict[str, Any]) -> dict[str, Any]:
    refs = [r for r in obj["metadata"].get("ownerReferences") or [] if r.get("controller")]
    assert len(refs) == 1, f"{obj['kind']} {obj['metadata']['name']} has controller references {refs}"
    return refs[0]


# -- tests ------------------------------------------------------------------------------------------------


def test_the_operator_runs_as_the_charts_service_account(e2e: E2E) -> None:
    if isinstance(e2e.operator, LocalOperator):
        whoami = ExistingCluster(e2e.operator.kubeconfig).kubectl("auth", "whoami", "-o", "json")
        assert json.loads(whoami.stdout)["status"]["userInfo"]["username"] == e2e.operator.user
        assert "client-certificate" not in e2e.operator.kubeconfig.read_text()  # nothing but the token
    deployment = release_deployment(e2e.kube)
    assert e2e.operator.user.endswith(f":{deployment['spec']['template']['spec']['serviceAccountName']}")
    can_i = e2e.kube.kubectl("auth", "can-i", "create", "pods", f"--as={e2e.operator.user}", check=False)
    assert can_i.stdout.strip() == "no"  # the chart grants what the operator needs, not more


def test_builtin_edit_and_view_roles_include_rltrainingjobs(e2e: E2E, ns: str) -> None:
    """The chart's aggregated ClusterRoles reach the built-in roles through Kubernetes' aggregation controller:
    a user bound to `edit` in a namespace creates jobs there, one bound to `view` only reads them."""
    bindings = [
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": f"{user}-{role}", "namespace": ns},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
         "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]}
        for user, role in (("e2e-editor", "edit"), ("e2e-viewer", "view"))
    ]
    e2e.kube.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": bindings}))
    rlj = f"rltrainingjobs.{API_GROUP}"

    def can(user: str, verb: str, *more: str) -> bool:
        answer = e2e.kube.kubectl("auth", "can-i", verb, rlj, *more, "-n", ns, f"--as={user}", check=False)
        return answer.stdout.strip() == "yes"

    eventually(lambda: can("e2e-editor", "create") and can("e2e-viewer", "list"), WAIT_S,
               "the built-in edit and view roles include rltrainingjobs")
    assert can("e2e-editor", "delete") and can("e2e-editor", "get", "--subresource=status")
    assert not can("e2e-editor", "patch", "--subresource=status")  # the operator's alone
    assert can("e2e-viewer", "watch") and can("e2e-viewer", "get", "--subresource=status")
    assert not can("e2e-viewer", "create") and not can("e2e-viewer", "delete")


def test_example_job_runs_on_a100_nodes_and_its_status_follows_kuberay(e2e: E2E, ns: str) -> None:
    a100 = e2e.products("A100-80GB")
    e2e.fleet.require("examples/ppo-job.yaml (2 actor + 1 critic pods of 8 GPUs)", a100, 3)
    job = apply(e2e, example_job(e2e, ns))

    # RLTrainingJob -> RayJob (ours) -> RayCluster (KubeRay's) -> pods (KubeRay's, bound by the scheduler)
    groups = wait_bound(e2e, ns, job, count=4)
    rayjob = rayjob_of(e2e, ns, job)
    uid = job_of(e2e, ns, job)["metadata"]["uid"]
    assert controller_of(rayjob)["uid"] == uid
    cluster_name = rayjob["status"]["rayClusterName"]
    raycluster = get(e2e, "raycluster", ns, cluster_name)
    assert raycluster is not None
    assert controller_of(raycluster)["uid"] == rayjob["metadata"]["uid"]
    for pod in [p for pods in groups.values() for p in pods]:
        assert pod["metadata"]["labels"]["ray.io/cluster"] == cluster_name

    assert sorted(groups) == ["actor", "critic", "head"]
    assert len(groups["actor"]) == 2 and len(groups["critic"]) == 1
    workers = groups["actor"] + groups["critic"]
    assert all(product_of(e2e, p) in a100 for p in workers), pod_summary(workers)
    assert len({p["spec"]["nodeName"] for p in workers}) == 3  # 8 GPUs each: one per node
    (head,) = groups["head"]
    assert head["spec"]["nodeName"] in e2e.fleet.cpu_nodes, pod_summary([head])

    # the status shows the RayJob and the RayCluster, and follows them
    status = wait_job(
        e2e, ns, job, lambda j: (j.get("status") or {}).get("rayClusterName") == cluster_name, "rayClusterName"
    )["status"]
    assert status["rayJobName"] == rayjob["metadata"]["name"]
    if not e2e.pods_run:
        # Real nodes: how far the Ray pods get depends on the runtime image (without it the head never
        # gets Ready and KubeRay stays Initializing). Whatever KubeRay says, the job says too.
        def mirrored() -> str | None:
            deployment = (rayjob_of(e2e, ns, job).get("status") or {}).get("jobDeploymentStatus")
            status = job_of(e2e, ns, job).get("status") or {}
            return deployment if deployment and status.get("jobDeploymentStatus") == deployment else None

        wait_for(e2e, ns, job, mirrored, "the job's jobDeploymentStatus is the RayJob's")
        return
    found = wait_job(e2e, ns, job, lambda j: condition(j, "Ready").get("status") == "True", "Ready=True")
    rayjob = rayjob_of(e2e, ns, job)
    assert rayjob["status"]["jobDeploymentStatus"] == "Running"
    raycluster = get(e2e, "raycluster", ns, cluster_name)
    assert raycluster is not None and raycluster["status"]["state"] == "ready"
    assert found["status"]["phase"] == "Running"
    assert found["status"]["jobDeploymentStatus"] == "Running"
    assert found["status"]["dashboardUrl"] == rayjob["status"]["dashboardURL"]
    assert condition(found, "Reconciling")["status"] == "False"
    assert condition(found, "Succeeded")["status"] == "False" and condition(found, "Failed")["status"] == "False"
    assert found["status"]["observedGeneration"] == found["metadata"]["generation"]


def test_reward_pods_share_nodes_with_the_actor_when_the_layout_asks(e2e: E2E, ns: str) -> None:
    a100 = e2e.products("A100-80GB")
    e2e.fleet.require("the co-location layout (2 actor + 1 critic pods of 8 GPUs)", a100, 3)
    doc = example_job(e2e, ns, "colocated")
    # a reward function in a pool of its own, fed by the actor: placed next to it
    doc["spec"]["graph"] = reward_pool_graph({"CPU": 4})
    reward = {"name": "reward", "replicas": 2, "gpusPerWorker": 0, "cpusPerWorker": 16, "memory": "64Gi"}
    if e2e.shrink:
        reward |= {"cpusPerWorker": 1, "memory": "512Mi"}
    doc["spec"]["cluster"]["workerGroups"].append(reward)
    job = apply(e2e, doc)

    groups = wait_bound(e2e, ns, job, count=6)
    actor_nodes = {p["spec"]["nodeName"] for p in groups["actor"]}
    reward_nodes = {p["spec"]["nodeName"] for p in groups["reward"]}
    assert reward_nodes <= actor_nodes, f"reward pods off the actor's nodes:\n{pod_summary(groups['reward'])}"
    for pod in groups["reward"]:
        limits = pod["spec"]["containers"][0]["resources"].get("limits") or {}
        assert GPU not in limits  # the reward pool holds no GPUs; it only sits next to them


def test_not_enough_a100s_leaves_pods_pending_and_the_job_says_why(e2e: E2E, ns: str) -> None:
    a100 = e2e.products("A100-80GB")
    nodes = e2e.fleet.nodes_of(a100)
    e2e.fleet.require("the capacity test", a100, 1)
    doc = example_job(e2e, ns, "too-wide")
    doc["spec"]["cluster"]["workerGroups"][0]["replicas"] = len(nodes)  # + 1 critic pod: one node short
    job = apply(e2e, doc)

    def scheduled(pod: dict[str, Any]) -> dict[str, Any]:
        return next((c for c in pod["status"].get("conditions") or [] if c["type"] == "PodScheduled"), {})

    def one_pending() -> list[dict[str, Any]] | None:  # bindings are asynchronous: let them all land
        pods = ray_pods(e2e, ns, job)
        pending = [p for p in pods if not p["spec"].get("nodeName")]
        settled = len(pods) == len(nodes) + 2 and len(pending) == 1 and scheduled(pending[0]).get("status") == "False"
        return pending if settled else None

    pending = wait_for(e2e, ns, job, one_pending, "all Ray pods bound but one, which the scheduler turned down")
    verdict = scheduled(pending[0])
    assert verdict["reason"] == "Unschedulable" and f"Insufficient {GPU}" in verdict["message"], verdict

    stuck = pending[0]["metadata"]["name"]
    found = wait_job(
        e2e,
        ns,
        job,
        lambda j: condition(j, "Ready").get("reason") == "Unschedulable" and stuck in condition(j, "Ready")["message"],
        f"Ready=False reason Unschedulable naming {stuck}",
    )
    ready = condition(found, "Ready")
    assert ready["status"] == "False" and f"Insufficient {GPU}" in ready["message"]
    assert condition(found, "Reconciling")["status"] == "True"
    assert condition(found, "Reconciling")["reason"] == "Unschedulable"
    assert condition(found, "Stalled")["status"] == "False"  # capacity may still come: not a dead end
    assert found["status"]["phase"] == "Pending"
    assert found["status"]["jobDeploymentStatus"] == "Initializing"  # KubeRay waits for the RayCluster


def test_suspend_releases_the_ray_pods_and_resume_brings_them_back(e2e: E2E, ns: str) -> None:
    e2e.fleet.require("the suspend test", e2e.products("A100-80GB"), 3)
    job = apply(e2e, example_job(e2e, ns, "pause"))
    wait_bound(e2e, ns, job, count=4)
    first = wait_job(e2e, ns, job, lambda j: bool((j.get("status") or {}).get("rayClusterName")), "rayClusterName")
    first_cluster = first["status"]["rayClusterName"]
    if e2e.pods_run:
        wait_job(e2e, ns, job, lambda j: condition(j, "Ready").get("status") == "True", "Ready=True")

    set_suspend(e2e, ns, job, True)
    found = wait_job(
        e2e, ns, job, lambda j: condition(j, "Suspended").get("reason") == "Suspended", "Suspended (settled)"
    )
    assert condition(found, "Suspended")["status"] == "True"
    assert found["status"]["phase"] == "Suspended"
    assert condition(found, "Ready")["status"] == "False" and condition(found, "Reconciling")["status"] == "False"
    wait_for(e2e, ns, job, lambda: not ray_pods(e2e, ns, job), "the Ray pods are deleted")
    wait_for(e2e, ns, job, lambda: get(e2e, "raycluster", ns, first_cluster) is None, "the RayCluster is deleted")
    assert rayjob_of(e2e, ns, job)["status"]["jobDeploymentStatus"] == "Suspended"

    set_suspend(e2e, ns, job, False)
    groups = wait_bound(e2e, ns, job, count=4)
    found = wait_job(
        e2e,
        ns,
        job,
        lambda j: (j.get("status") or {}).get("rayClusterName") not in (None, first_cluster),
        "a new RayCluster",
    )
    assert condition(found, "Suspended")["status"] == "False"
    assert {p["metadata"]["labels"]["ray.io/cluster"] for ps in groups.values() for p in ps} == {
        found["status"]["rayClusterName"]
    }
    if e2e.pods_run:
        found = wait_job(e2e, ns, job, lambda j: condition(j, "Ready").get("status") == "True", "Ready=True again")
        assert found["status"]["phase"] == "Running"


def test_deleting_the_job_collects_rayjob_raycluster_and_pods(e2e: E2E, ns: str) -> None:
    e2e.fleet.require("the deletion test", e2e.products("A100-80GB"), 3)
    job = apply(e2e, example_job(e2e, ns, "gone"))
    wait_bound(e2e, ns, job, count=4)
    rayjob = rayjob_of(e2e, ns, job)
    cluster_name = wait_for(
        e2e, ns, job, lambda: (rayjob_of(e2e, ns, job).get("status") or {}).get("rayClusterName"), "rayClusterName"
    )

    e2e.kube.kubectl("delete", "rltrainingjob", job, "-n", ns, f"--timeout={int(WAIT_S)}s", timeout=WAIT_S + 10)
    owned = ("configmap", "serviceaccount", "role.rbac.authorization.k8s.io", "rolebinding.rbac.authorization.k8s.io")

    def collected() -> bool:
        gone = [
            get(e2e, "rayjob", ns, rayjob["metadata"]["name"]) is None,
            get(e2e, "raycluster", ns, cluster_name) is None,
            not e2e.kube.get_json("pods", "-n", ns)["items"],  # the submitter's pod too
            not e2e.kube.get_json("jobs.batch", "-n", ns)["items"],
        ]
        gone += [not e2e.kube.get_json(kind, "-n", ns, "-l", f"{names.JOB_LABEL}={job}")["items"] for kind in owned]
        return all(gone)

    eventually(collected, WAIT_S, "garbage collection of the RayJob, the RayCluster, the pods and owned objects")


def test_an_h100_job_lands_only_on_h100_nodes(e2e: E2E, ns: str) -> None:
    h100 = e2e.products("H100-80GB")
    nodes = e2e.fleet.nodes_of(h100)
    e2e.fleet.require("the H100 test (actor + critic pods of 8 GPUs)", h100, 2)
    doc = example_job(e2e, ns, "on-h100")
    doc["spec"]["cluster"]["gpuType"] = "H100-80GB"
    actor = doc["spec"]["cluster"]["workerGroups"][0]
    actor["replicas"] = min(actor["replicas"], len(nodes) - 1)  # same job, as wide as the H100 nodes allow
    job = apply(e2e, doc)

    groups = wait_bound(e2e, ns, job, count=2 + actor["replicas"])
    workers = groups["actor"] + groups["critic"]
    assert all(product_of(e2e, p) in h100 for p in workers), pod_summary(workers)
    assert groups["head"][0]["spec"]["nodeName"] in e2e.fleet.cpu_nodes


def test_a_permission_missing_from_the_chart_fails_the_suite(e2e: E2E, ns: str) -> None:
    """The 403 check above is real: take one verb out of the chart's ClusterRole and watch it fire."""
    selector = f"app.kubernetes.io/instance={RELEASE}"
    roles = [
        r
        for r in e2e.kube.get_json("clusterroles", "-l", selector)["items"]
        if any(
            API_GROUP in rule.get("apiGroups", []) and "rltrainingjobs/status" in rule.get("resources", [])
            and "patch" in rule.get("verbs", [])
            for rule in r.get("rules") or []
        )
    ]
    assert len(roles) == 1, f"expected one ClusterRole of release {RELEASE} granting patch on rltrainingjobs/status"
    original = roles[0]
    trimmed = json.loads(json.dumps(original))
    for rule in trimmed["rules"]:
        if "rltrainingjobs/status" in rule.get("resources", []):
            rule["verbs"] = [v for v in rule["verbs"] if v != "patch"]
    trimmed["rules"] = [rule for rule in trimmed["rules"] if rule["verbs"]]  # a rule needs a verb
    for meta in (original, trimmed):
        meta["metadata"].pop("resourceVersion", None)

    job = "refused"
    doc = example_job(e2e, ns, job)
    doc["spec"]["runPolicy"]["suspend"] = True  # nothing to schedule: only the status write matters here
    e2e.kube.kubectl("replace", "-f", "-", input=json.dumps(trimmed))
    try:
        apply(e2e, doc)
        refused = wait_for(e2e, ns, job, lambda: e2e.forbidden_since_mark(), "the operator logs a 403")
        # Here the API server refuses the per-job Role first: the operator may grant only what it holds.
        assert e2e.operator.user in "\n".join(refused), refused
        unwritten = job_of(e2e, ns, job)["status"]
        assert unwritten["observedGeneration"] == 0 and not unwritten.get("conditions"), unwritten  # the CRD default
    finally:
        e2e.kube.kubectl("replace", "-f", "-", input=json.dumps(original))
    wait_job(
        e2e, ns, job, lambda j: condition(j, "Suspended").get("status") == "True", "status written once allowed again"
    )
    time.sleep(1)
    e2e.log_mark = len(e2e.operator.log())  # those 403s were this test's point
