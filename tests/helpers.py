"""Helpers shared by the suites in tests/ and e2e/ (import them as `tests.helpers`)."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shlex
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import pytest


def templates_of(rayjob: Mapping[str, Any]) -> dict[str, dict]:
    """A RayJob's Ray pod templates: the head's ("head"), then each worker group's, by group name."""
    cluster = rayjob["spec"]["rayClusterSpec"]
    return {"head": cluster["headGroupSpec"]["template"],
            **{g["groupName"]: g["template"] for g in cluster["workerGroupSpecs"]}}


def env_of(template: Mapping[str, Any]) -> dict[str, str | None]:
    """Name -> value of the container's variables (None for those taken from a Secret or the pod)."""
    return {e["name"]: e.get("value") for e in template["spec"]["containers"][0]["env"]}


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def unavailable(message: str) -> NoReturn:
    """Skip a test that needs something absent, except under CI=true, where it must run: fail it."""
    if in_ci():
        pytest.fail(message)
    pytest.skip(message)


@contextlib.contextmanager
def minimal_apiserver(tmp_path_factory: pytest.TempPathFactory, crd_files: Sequence[Path] = ()) -> Iterator[Any]:
    """etcd + kube-apiserver of the e2e harness (RBAC on, no controllers) with `crd_files` installed."""
    from e2e.harness import binaries
    from e2e.harness.controlplane import ControlPlane

    absent = binaries.missing(binaries.MINIMAL)
    if absent:
        unavailable(f"kube-apiserver/etcd not built ({', '.join(absent)}): run `bash e2e/toolchain/build.sh "
                    "etcd kube-apiserver` (Go >= 1.24) or set KUBEBUILDER_ASSETS")
    cp = ControlPlane(work_dir=tmp_path_factory.mktemp("apiserver"), install_kuberay_crds=False, allow_build=False)
    cp.start()
    try:
        cp.install_crds(crd_files)
        yield cp
    finally:
        cp.stop()


@dataclass(frozen=True)
class Verdict:
    """What the API server said to a create: admitted with the object it would store, or refused and why."""

    admitted: bool
    body: dict[str, Any]

    @property
    def message(self) -> str:
        return str(self.body.get("message", ""))


def as_kubectl_sends(value: Any) -> Any:
    """A decoded YAML file's numbers as kubectl and GitOps tools send them: they turn YAML into JSON in Go, which
    writes a float64 with no fraction below 1e21 as digits alone (YAML's 2.0 arrives as the integer 2; JSON's
    2.0 would stay a float, which a CEL rule reading an integer refuses)."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e21:
        return int(value)
    if isinstance(value, Mapping):
        return {k: as_kubectl_sends(v) for k, v in value.items()}
    if isinstance(value, list):
        return [as_kubectl_sends(v) for v in value]
    return value


class DryRun:
    """Dry-run creates of RLTrainingJobs over one kept-alive HTTPS connection: the API server's whole admission
    (strict field validation, schema, defaults, CEL rules) and nothing stored; a few ms each, where a kubectl
    process costs a few hundred."""

    def __init__(self, cp: Any, namespace: str = "default") -> None:
        from hybridflow.api import API_GROUP, API_VERSION, PLURAL

        url = urllib.parse.urlsplit(cp.server)
        self._host, self._port = url.hostname or "127.0.0.1", url.port or 443
        self._context = cp.admin_tls_context()
        self._path = (f"/apis/{API_GROUP}/{API_VERSION}/namespaces/{namespace}/{PLURAL}"
                      "?dryRun=All&fieldValidation=Strict")
        self._conn: http.client.HTTPSConnection | None = None

    def create(self, obj: Mapping[str, Any]) -> Verdict:
        body = json.dumps(as_kubectl_sends(obj), allow_nan=False).encode()
        for attempt in range(2):
            if self._conn is None:
                self._conn = http.client.HTTPSConnection(self._host, self._port, context=self._context, timeout=30)
            try:
                self._conn.request("POST", self._path, body, {"Content-Type": "application/json"})
                response = self._conn.getresponse()
                status, answer = response.status, json.loads(response.read() or b"{}")
                break
            except (OSError, http.client.HTTPException):
                self.close()  # the server closed an idle connection: once more on a new one
                if attempt:
                    raise
        if status in (400, 422):
            return Verdict(False, answer)
        assert status == 201, f"dry-run create answered {status}: {answer}"
        return Verdict(True, answer)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


POD_STORAGE_FIELDS = ("volumes", "volumeMounts", "env", "envFrom")


def without_pod_storage(job: dict[str, Any]) -> dict[str, Any]:
    """The job without the PVCs and Secrets its pods read (spec.cluster volumes and env): a test control
    plane has no storage provisioner and no such Secrets, and pods mounting a missing PVC never schedule."""
    cluster = job.get("spec", {}).get("cluster", {})
    for key in POD_STORAGE_FIELDS:
        cluster.pop(key, None)
    return job


def condition(job: Mapping[str, Any], kind: str) -> dict[str, Any]:
    """The job's status condition of this type, {} when it has none."""
    return next((c for c in (job.get("status") or {}).get("conditions") or [] if c["type"] == kind), {})


def reward_pool_graph(reward_resources: Mapping[str, float]) -> dict[str, Any]:
    """A custom PPO graph whose reward function runs in a pool of its own, fed by the actor (so placed next
    to it); actor and reference share the `actor` pool, the critic has its own."""
    return {
        "nodes": [
            {"name": "actor", "role": "actor_rollout", "resources": {"GPU": 1}, "parallelism": 16, "pool": "actor"},
            {"name": "ref", "role": "reference", "resources": {}, "parallelism": 16, "pool": "actor"},
            {"name": "score", "role": "reward", "resources": dict(reward_resources), "parallelism": 4,
             "pool": "reward"},
            {"name": "critic", "role": "critic", "resources": {"GPU": 1}, "parallelism": 8, "pool": "critic"},
        ],
        "edges": [
            {"src": "actor", "dst": "ref", "coLocate": True},
            {"src": "actor", "dst": "score", "dataType": "rollout_batch"},
            {"src": "score", "dst": "critic", "dataType": "rewarded_batch"},
            {"src": "critic", "dst": "actor", "control": True},
        ],
    }


@dataclass(frozen=True)
class BadPodSetting:
    """spec.cluster pod settings that cannot work, refused alike by the models and the API server (CEL):
    both name `field` and say `says`, unless the API server's own check (a list-map's duplicate key, a
    value's JSON type or length) speaks."""

    case: str
    cluster: dict[str, Any]
    field: str
    says: str
    api_field: str | None = None
    api_says: str | None = None


_MODELS = {"name": "models", "persistentVolumeClaim": {"claimName": "models-pvc"}}


def _mounted(*mounts: dict[str, Any], volumes: Sequence[dict[str, Any]] = (_MODELS,)) -> dict[str, Any]:
    return {"volumes": list(volumes), "volumeMounts": list(mounts)}


def _env(*env: dict[str, Any]) -> dict[str, Any]:
    return {"env": list(env)}


BAD_POD_SETTINGS = [
    BadPodSetting("mount-of-no-volume", _mounted({"name": "data", "mountPath": "/mnt/data"}),
                  "spec.cluster.volumeMounts", "in cluster.volumes"),
    BadPodSetting("mount-without-volumes", {"volumeMounts": [{"name": "data", "mountPath": "/mnt/data"}]},
                  "spec.cluster.volumeMounts", "in cluster.volumes"),
    BadPodSetting("volume-named-twice", {"volumes": [_MODELS, {"name": "models", "emptyDir": {}}]},
                  "spec.cluster.volumes", "appears more than once",
                  api_field="spec.cluster.volumes[1]", api_says="Duplicate value"),
    BadPodSetting("mount-path-twice",
                  _mounted({"name": "models", "mountPath": "/mnt/m"}, {"name": "models", "mountPath": "/mnt/m"}),
                  "spec.cluster.volumeMounts", "appears more than once",
                  api_field="spec.cluster.volumeMounts[1]", api_says="Duplicate value"),
    BadPodSetting("env-set-twice", _env({"name": "A", "value": "1"}, {"name": "A", "value": "2"}),
                  "spec.cluster.env", "appears more than once",
                  api_field="spec.cluster.env[1]", api_says="Duplicate value"),
    BadPodSetting("operator-volume-dshm", {"volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]},
                  "spec.cluster.volumes[0].name", "are the operator's own"),
    BadPodSetting("operator-volume-config", {"volumes": [{"name": "hybridflow-config", "emptyDir": {}}]},
                  "spec.cluster.volumes[0].name", "are the operator's own"),
    BadPodSetting("mount-at-dev-shm", _mounted({"name": "models", "mountPath": "/dev/shm"}),
                  "spec.cluster.volumeMounts[0].mountPath", "are the operator's own mounts"),
    BadPodSetting("mount-in-config-dir", _mounted({"name": "models", "mountPath": "/etc/hybridflow/extra"}),
                  "spec.cluster.volumeMounts[0].mountPath", "are the operator's own mounts"),
    BadPodSetting("relative-mount-path", _mounted({"name": "models", "mountPath": "mnt/models"}),
                  "spec.cluster.volumeMounts[0].mountPath", "mountPath must be an absolute path"),
    BadPodSetting("mount-path-with-dotdot", _mounted({"name": "models", "mountPath": "/mnt/../etc"}),
                  "spec.cluster.volumeMounts[0].mountPath", "mountPath must be an absolute path"),
    BadPodSetting("absolute-sub-path", _mounted({"name": "models", "mountPath": "/mnt/m", "subPath": "/data"}),
                  "spec.cluster.volumeMounts[0].subPath", "subPath must be a relative path"),
    BadPodSetting("volume-with-two-sources",
                  {"volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "m"}, "emptyDir": {}}]},
                  "spec.cluster.volumes[0]", "needs exactly one of persistentVolumeClaim"),
    BadPodSetting("volume-without-source", {"volumes": [{"name": "models"}]},
                  "spec.cluster.volumes[0]", "needs exactly one of persistentVolumeClaim"),
    BadPodSetting("relative-host-path", {"volumes": [{"name": "cache", "hostPath": {"path": "cache"}}]},
                  "spec.cluster.volumes[0].hostPath.path", "hostPath.path must be an absolute path"),
    BadPodSetting("operator-variable", _env({"name": "HYBRIDFLOW_CONFIG", "value": "/tmp/job.json"}),
                  "spec.cluster.env[0].name", "are set by the operator"),
    BadPodSetting("nccl-variable-of-cluster-nccl", _env({"name": "NCCL_SOCKET_IFNAME", "value": "eth1"}),
                  "spec.cluster.env[0].name", "are set by the operator"),
    BadPodSetting("value-and-value-from",
                  _env({"name": "HF_TOKEN", "value": "x",
                        "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}}),
                  "spec.cluster.env[0]", "takes value or valueFrom, not both"),
    BadPodSetting("value-from-two-sources",
                  _env({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "a", "key": "k"},
                                                          "configMapKeyRef": {"name": "b", "key": "k"}}}),
                  "spec.cluster.env[0].valueFrom", "needs exactly one of secretKeyRef"),
    BadPodSetting("env-from-two-sources",
                  {"envFrom": [{"secretRef": {"name": "a"}, "configMapRef": {"name": "b"}}]},
                  "spec.cluster.envFrom[0]", "needs exactly one of secretRef"),
    BadPodSetting("pod-label-of-kuberay", {"podLabels": {"ray.io/group": "actor"}},
                  "spec.cluster.podLabels", "belong to the operator and KubeRay"),
    BadPodSetting("pod-annotation-of-the-operator", {"podAnnotations": {"hybridflow.io/generation": "1"}},
                  "spec.cluster.podAnnotations", "belong to the operator and KubeRay"),
]

# The two CPU amounts of spec.cluster (a Kubernetes CPU quantity: cores or millicores), refused by the models
# and by the CRD's rule with one message; for a value of the wrong JSON type or longer than the schema's
# maxLength, the API server's own check speaks instead (and no rule runs).
_CPU_AMOUNT = "must be a CPU amount above 0 and at most 1024 cores"
_NOT_INT_OR_STRING = "must be of type integer,string"
BAD_CPU_AMOUNTS: list[tuple[Any, str | None]] = [
    (0, None), (-1, None), (1025, None), ("0", None), ("0m", None), ("-1", None), ("1025", None), ("1024.5", None),
    ("1024001m", None), ("1.0001", None), ("1.5m", None), ("1Gi", None), ("500M", None), ("two", None), ("", None),
    (1.5, _NOT_INT_OR_STRING), (True, _NOT_INT_OR_STRING), ("1" * 17, "Too long"),
]


def _cpu_fields(value: Any) -> list[tuple[str, dict[str, Any], str]]:
    group = {"name": "default", "cpusPerWorker": value}
    return [("headCpus", {"headCpus": value}, "spec.cluster.headCpus"),
            ("cpusPerWorker", {"workerGroups": [group]}, "spec.cluster.workerGroups[0].cpusPerWorker")]


BAD_POD_SETTINGS += [
    BadPodSetting(f"{name}-{value!r}", cluster, field, _CPU_AMOUNT, api_says=api_says)
    for value, api_says in BAD_CPU_AMOUNTS
    for name, cluster, field in _cpu_fields(value)
]


def kuberay_resources(raw: str) -> dict:
    """A worker group's rayStartParams.resources read the way KubeRay reads it (quotes trimmed, JSON), and as
    bash passes it to `ray start` (shell-split): both must give the same object."""
    parsed = json.loads(raw.strip("'\"` "))
    (arg,) = shlex.split(f"--resources={raw}")
    assert json.loads(arg.removeprefix("--resources=")) == parsed
    return parsed


def pooled_ppo_graph() -> dict[str, Any]:
    """PPO with a reward node of its own (scalable), a critic with ranks, and an actor planned without ranks."""
    return {
        "nodes": [
            {"name": "actor_rollout", "role": "actor_rollout", "resources": {"CPU": 1}, "pool": "actor"},
            {"name": "reference", "role": "reference", "pool": "actor"},
            {"name": "reward", "role": "reward", "resources": {"CPU": 0.5}, "pool": "reward"},
            {"name": "critic", "role": "critic", "resources": {"CPU": 1}, "pool": "critic"},
        ],
        "edges": [
            {"src": "actor_rollout", "dst": "reference", "coLocate": True},
            {"src": "actor_rollout", "dst": "reward", "dataType": "rollout_batch"},
            {"src": "critic", "dst": "actor_rollout", "dataType": "updated_policy", "control": True},
        ],
    }


class TrainingThread:
    """A job trained through the driver in a daemon thread; `result` or `error` holds how it ended."""

    def __init__(self, job: Any, metrics: Path) -> None:
        self.job, self.metrics = job, metrics
        self.result: dict[str, Any] | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._train, daemon=True)

    def _train(self) -> None:
        from hybridflow.driver import run_training

        try:
            self.result = run_training(self.job, str(self.metrics))
        except BaseException as e:
            self.error = e

    def records(self) -> list[dict[str, Any]]:
        if not self.metrics.is_file():
            return []
        return [json.loads(line) for line in self.metrics.read_text().splitlines() if line.strip()]

    def steps(self) -> list[int]:
        return [r["step"] for r in self.records()]


def wait_for(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll `cond` every 0.2 s; AssertionError names `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}")
        time.sleep(0.2)


def right_padded_mask(lengths: list[int], num_tokens: int) -> Any:
    """[B, T] mask of 1s on each row's first `lengths[i]` tokens (a torch tensor)."""
    import torch

    return (torch.arange(num_tokens)[None, :] < torch.tensor(lengths)[:, None]).long()


@dataclass(frozen=True)
class HubName:
    """A value of a field that may name the Hub, and whether the models and the API server take it."""

    field: str
    """spec.model.policy.path or spec.data.train."""
    value: str
    accepted: bool


_COMMIT = "0123456789abcdef0123456789abcdef01234567"
HUB_NAMES = [
    *(HubName("spec.model.policy.path", v, True) for v in (
        "Qwen/Qwen2.5-0.5B-Instruct", "hf://Qwen/Qwen2.5-0.5B-Instruct", "hf://Qwen/Qwen2.5-0.5B-Instruct@main",
        f"hf://gpt2@{_COMMIT}", "hf://org/name@v1.0", "/mnt/models/qwen", "./org/name", "builtin:tiny")),
    *(HubName("spec.model.policy.path", v, False) for v in (
        "hf://", "hf://Qwen/", "hf://a/b/c", "hf://a/b@", "hf://a/b@feature/x", "hf://datasets/org/name",
        "hf://-a/b", "hf://a b/c", "hf://a/b\n")),
    *(HubName("spec.data.train", v, True) for v in (
        "hf://datasets/openai/gsm8k", "hf://datasets/openai/gsm8k/main?split=test",
        "hf://datasets/org/name@v1/cfg?split=train", "hf://datasets/org/name?split=validation",
        "/mnt/data/train.parquet", "builtin:tiny_task")),
    *(HubName("spec.data.train", v, False) for v in (
        "hf://datasets/gsm8k", "hf://org/name", "hf://datasets/org/name?split=", "hf://datasets/org/name/cfg/extra",
        "hf://datasets/org/name?revision=v1")),
]
"""Hub names both tests/test_hub.py (the models) and tests/test_crd.py (the API server's rule) check."""


def hub_name_spec(name: HubName) -> dict[str, Any]:
    """The smallest spec that sets `name.field` to `name.value`."""
    if name.field == "spec.data.train":
        return {"data": {"train": name.value}}
    return {"model": {"policy": {"path": name.value}}}


def greedy_tokens(model: Any, tokenizer: Any, prompts: Sequence[str], new_tokens: int = 4) -> Any:
    """The tokens `model` generates greedily after each prompt (left-padded batch), as a [B, new_tokens] tensor."""
    import torch

    tokenizer.padding_side = "left"
    enc = tokenizer(list(prompts), return_tensors="pt", padding=True)
    model.eval()
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    return out[:, enc["input_ids"].shape[1]:]


def policy_from_checkpoint(directory: Path, spec: Any) -> Any:
    """The policy of a checkpoint directory as the runtime itself restores it: an actor worker, its state loaded."""
    import torch

    from hybridflow.checkpoint import load_state, training_dir
    from hybridflow.workers.actor import ActorRolloutWorker

    worker = ActorRolloutWorker(spec, torch.device("cpu"))
    worker.load_state_dict(load_state(directory / "actor_rollout_0.pt")["roles"]["actor_rollout"])
    worker.load_training(str(training_dir(directory, "actor_rollout_0", "actor_rollout")))
    return worker.model


def train_in_fresh_ray(job: Any, metrics: Path) -> dict[str, Any]:
    """One run of `job` in a local Ray of its own, shut down after it (a module fixture's whole run)."""
    import ray

    from hybridflow.driver import init_ray, run_training

    init_ray(local=True, num_cpus=8)
    try:
        return run_training(job, str(metrics))
    finally:
        ray.shutdown()
