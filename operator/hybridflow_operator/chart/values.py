"""The Helm chart's values (charts/hybridflow/values.yaml) as typed models: the one source of its schema and README.

values.yaml is written by hand, with its comments; tests/test_chart.py checks that it validates against
`ChartValues` and that its defaults are the model's. Values that are whole Kubernetes objects the chart
copies into the pod unchanged (security contexts, affinity, an env var's valueFrom) stay free-form here:
the API server validates them, and their schemas are Kubernetes' own.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from hybridflow.api.base import ApiModel
from hybridflow.api.pod import EnvName, ObjectName
from hybridflow.k8s.contract import DEFAULT_PROGRESS_INTERVAL
from hybridflow.k8s.settings import DEFAULT_GPU_PRODUCTS

Port = Annotated[int, Field(ge=1, le=65535)]
DnsLabel = Annotated[str, Field(min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")]
Duration = Annotated[str, Field(pattern=r"^([0-9]+(ms|s|m|h))+$")]
"""A Prometheus duration such as 30s or 1m30s."""
Amount = int | float | str
"""A resource quantity as in a pod spec: 1, 0.5, "500m", "256Mi"."""
ProductName = Annotated[str, Field(min_length=1)]
ProductNames = Annotated[list[ProductName], Field(min_length=1)] | ProductName
"""nvidia.com/gpu.product values: a list of them, or one."""
StringMap = dict[str, str]


class ValuesModel(ApiModel):
    """camelCase keys, unknown ones refused, and strict types: "8080" is no port, as for Helm's schema check."""

    model_config = ConfigDict(strict=True)


class Image(ValuesModel):
    """The operator's container image."""

    repository: str = Field("docker.io/hybridflow/operator", min_length=1)
    """Built from docker/operator.Dockerfile."""
    tag: str = ""
    """Defaults to the chart's appVersion. Pass a numeric tag with --set-string."""
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    """Kubernetes imagePullPolicy of the operator container."""


class Crds(ValuesModel):
    """The RLTrainingJob CustomResourceDefinition."""

    install: bool = True
    """Install the RLTrainingJob CRD with the chart (and upgrade it with the chart)."""
    keep: bool = True
    """Keep the CRD when the release is uninstalled: deleting it would delete every RLTrainingJob."""


class ServiceAccount(ValuesModel):
    """The operator's identity."""

    create: bool = True
    """Create the operator's ServiceAccount; when false, `name` (or `default`) must already exist."""
    name: str = ""
    """Defaults to the release's full name."""
    annotations: StringMap = Field(default_factory=dict)
    """Annotations of the ServiceAccount (for example a cloud workload identity)."""


class Rbac(ValuesModel):
    """Roles of the operator and of the people who use RLTrainingJobs."""

    create: bool = True
    """Create the ClusterRole/Roles and bindings the operator needs (see templates/rbac.yaml)."""
    aggregate_roles: bool = True
    """With `create`: ClusterRoles aggregated into the built-in `admin` and `edit` roles (create, change and
    delete RLTrainingJobs) and `view` (read them and their status), so namespace users need no extra binding."""


def _default_ingress_from() -> list[dict[str, Any]]:
    return [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}}}]


class NetworkPolicy(ValuesModel):
    """Ray's ports (GCS, dashboard, client, object transfer) have no authentication: anyone who reaches a job's
    head can run code as the job. Enabled, the operator creates a NetworkPolicy with every job (owned by it, in
    its namespace): the job's Ray pods accept traffic only from one another, from KubeRay's submitter pod of the
    job, from this operator's pods, and from the peers in `ingressFrom`. It needs a CNI that enforces
    NetworkPolicies. Reach the Ray dashboard with `kubectl port-forward` (not network traffic to the pod, so
    still allowed)."""

    enabled: bool = False
    """Create a NetworkPolicy with every job."""
    ingress_from: list[dict[str, Any]] = Field(default_factory=_default_ingress_from)
    """NetworkPolicyPeers the Ray pods also accept traffic from (Kubernetes' own schema). KubeRay's operator
    must reach each job's head (dashboard port 8265) to submit and follow the job: by default, pods labelled like
    the KubeRay chart's in any namespace; narrow the namespaceSelector to KubeRay's namespace. Add your
    Prometheus if it scrapes the Ray pods (metrics.podMonitor)."""


class Health(ValuesModel):
    """Liveness endpoint of the operator (kopf's /healthz): the process's own health, not the API server's."""

    port: Port = 8080
    """Container port of /healthz, probed by the liveness probe."""


class ServiceSettings(ValuesModel):
    """The Service in front of the operator's /metrics."""

    annotations: StringMap = Field(default_factory=dict)
    """Annotations of the metrics Service."""


class ServiceMonitor(ValuesModel):
    """A Prometheus Operator ServiceMonitor scraping the operator (needs the monitoring.coreos.com CRDs)."""

    enabled: bool = False
    """Render the ServiceMonitor."""
    interval: Duration = "30s"
    """Scrape interval."""
    labels: StringMap = Field(default_factory=dict)
    """Labels your Prometheus selects ServiceMonitors by (e.g. release: kube-prometheus-stack)."""


class PodMonitor(ValuesModel):
    """A Prometheus Operator PodMonitor scraping the Ray pods of every job, where Ray serves the runtime's
    metrics (needs the monitoring.coreos.com CRDs)."""

    enabled: bool = False
    """Render the PodMonitor."""
    interval: Duration = "30s"
    """Scrape interval."""
    labels: StringMap = Field(default_factory=dict)
    """Labels your Prometheus selects PodMonitors by."""


class Dashboard(ValuesModel):
    """The Grafana dashboard, shipped as a ConfigMap labelled for Grafana's dashboard sidecar."""

    enabled: bool = True
    """Render the dashboard ConfigMap."""
    namespace: str = ""
    """Defaults to the release's namespace; set it to where the Grafana sidecar looks."""
    labels: StringMap = Field(default_factory=lambda: {"grafana_dashboard": "1"})
    """Labels the Grafana sidecar selects dashboards by."""


class Metrics(ValuesModel):
    """Prometheus. The operator serves /metrics on `metrics.port` (0: none) behind a Service; the ServiceMonitor
    (operator) and PodMonitor (the Ray pods of every job) need the Prometheus Operator's CRDs, so they are off
    by default."""

    port: int = Field(8081, ge=0, le=65535)
    """Port of the operator's /metrics endpoint; 0 serves none (and renders no Service)."""
    service: ServiceSettings = Field(default_factory=ServiceSettings)
    service_monitor: ServiceMonitor = Field(default_factory=ServiceMonitor)
    pod_monitor: PodMonitor = Field(default_factory=PodMonitor)
    dashboard: Dashboard = Field(default_factory=Dashboard)


class PullSecret(ValuesModel):
    """A Secret holding registry credentials."""

    name: ObjectName
    """Name of a kubernetes.io/dockerconfigjson Secret in the release's namespace."""


class EnvVar(ValuesModel):
    """An environment variable of the operator container, as in a pod spec (HYBRIDFLOW_* settings included)."""

    name: EnvName
    """Variable name."""
    value: str | None = None
    """Its value (quote numbers in YAML)."""
    value_from: dict[str, Any] | None = None
    """A Kubernetes EnvVarSource (secretKeyRef, configMapKeyRef, fieldRef, resourceFieldRef)."""


class ResourceClaim(ValuesModel):
    """A dynamic resource claim of the pod used by this container."""

    name: str = Field(min_length=1)
    """Name of one of the pod's resourceClaims."""
    request: str | None = None
    """One request of that claim; all of them when unset."""


class Resources(ValuesModel):
    """Kubernetes ResourceRequirements of the operator container."""

    requests: dict[str, Amount] = Field(default_factory=dict)
    """Resources the scheduler reserves (cpu, memory, ...)."""
    limits: dict[str, Amount] = Field(default_factory=dict)
    """Resources the container may not exceed."""
    claims: list[ResourceClaim] | None = None
    """Dynamic resource claims (rarely needed by the operator)."""


class Toleration(ValuesModel):
    """A Kubernetes Toleration: lets the operator pod schedule onto nodes with a matching taint."""

    key: str | None = None
    """Taint key; unset with operator Exists tolerates every taint."""
    operator: Literal["Exists", "Equal"] | None = None
    """Equal (the default) matches `value`; Exists matches any value."""
    value: str | None = None
    """Taint value, with operator Equal."""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    """Taint effect to tolerate; unset: all of them."""
    toleration_seconds: int | None = None
    """With NoExecute: how long the pod stays bound after the taint appears; unset: forever."""


def _default_gpu_products() -> dict[str, ProductNames]:
    """The operator's built-in map (hybridflow.k8s.settings), which the chart passes on explicitly."""
    return {gpu: list(products) for gpu, products in DEFAULT_GPU_PRODUCTS.items()}


def _default_resources() -> Resources:
    return Resources(requests={"cpu": "100m", "memory": "256Mi"}, limits={"cpu": "1", "memory": "512Mi"})


def _default_pod_security_context() -> dict[str, Any]:
    return {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532, "fsGroup": 65532,
            "seccompProfile": {"type": "RuntimeDefault"}}


def _default_security_context() -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]}}


class ChartValues(ValuesModel):
    """Values of the hybridflow chart."""

    image: Image = Field(default_factory=Image)
    image_pull_secrets: list[PullSecret] = Field(default_factory=list)
    """Secrets for pulling the operator image, as in a pod spec: [{name: regcred}]."""
    name_override: str = ""
    """Replaces the chart's name in object names and the app.kubernetes.io/name label."""
    fullname_override: str = ""
    """Replaces `<release>-<chart>` as the name of the chart's objects."""
    runtime_image: str = ""
    """Image of the Ray head and worker pods when a job's spec.cluster.image is empty. Built from
    docker/runtime.Dockerfile (rayproject/ray at the default spec.cluster.rayVersion plus torch, vLLM and
    hybridflow). Empty means `docker.io/hybridflow/runtime:<appVersion>`."""
    watch_namespaces: list[DnsLabel] = Field(default_factory=list)
    """Namespaces whose RLTrainingJobs the operator reconciles. Empty: every namespace, with a ClusterRole.
    Otherwise a Role and RoleBinding in each listed namespace (which must exist)."""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Log level of the operator."""
    gpu_product_labels: dict[str, ProductNames] = Field(default_factory=_default_gpu_products)
    """spec.cluster.gpuType -> the nvidia.com/gpu.product node label values (as GPU feature discovery writes
    them) that Ray worker pods may be scheduled on. Equal to the operator's built-in defaults. Helm merges
    your entries into this map: add a gpuType, or set one to null to drop it."""
    progress_interval: float = Field(DEFAULT_PROGRESS_INTERVAL, gt=0)
    """Seconds between two status.progress patches of a running job, which its Ray pods write: about one API
    write per running job per interval. Lower shows `kubectl get rlj` moving sooner; higher spares the API
    server of a large fleet."""
    crds: Crds = Field(default_factory=Crds)
    service_account: ServiceAccount = Field(default_factory=ServiceAccount)
    rbac: Rbac = Field(default_factory=Rbac)
    network_policy: NetworkPolicy = Field(default_factory=NetworkPolicy)
    health: Health = Field(default_factory=Health)
    metrics: Metrics = Field(default_factory=Metrics)
    extra_args: list[str] = Field(default_factory=list)
    """Extra command-line flags of the operator (see `hybridflow-operator --help`)."""
    extra_env: list[EnvVar] = Field(default_factory=list)
    """Extra environment variables of the operator container. Tuning for large fleets (defaults in
    brackets): HYBRIDFLOW_STATUS_WRITES_PER_S (10) status writes per second for all jobs together,
    HYBRIDFLOW_SPIN_UP_JOBS (10) Ray clusters starting at once beyond which the rate of status writes is
    shared out among them (at least 1 a second), HYBRIDFLOW_STATUS_MIN_INTERVAL (1) seconds between two runs
    for one job, HYBRIDFLOW_MAX_REQUESTS (32) API requests in flight, HYBRIDFLOW_STATUS_INTERVAL (300)
    seconds between safety-net resyncs of every job."""
    resources: Resources = Field(default_factory=_default_resources)
    pod_security_context: dict[str, Any] = Field(default_factory=_default_pod_security_context)
    """Kubernetes PodSecurityContext of the operator pod."""
    security_context: dict[str, Any] = Field(default_factory=_default_security_context)
    """Kubernetes SecurityContext of the operator container (the chart mounts an emptyDir at /tmp, so the
    root filesystem can stay read-only)."""
    pod_annotations: StringMap = Field(default_factory=dict)
    """Annotations of the operator pod."""
    pod_labels: StringMap = Field(default_factory=dict)
    """Extra labels of the operator pod."""
    priority_class_name: str = ""
    """PriorityClass of the operator pod."""
    node_selector: StringMap = Field(default_factory=dict)
    """Node labels the operator pod must match."""
    tolerations: list[Toleration] = Field(default_factory=list)
    """Taints the operator pod tolerates."""
    affinity: dict[str, Any] = Field(default_factory=dict)
    """Kubernetes Affinity of the operator pod."""


def defaults() -> dict[str, Any]:
    """The model's defaults in values.yaml form (camelCase, unset optional fields left out)."""
    return ChartValues().to_yaml_dict()
