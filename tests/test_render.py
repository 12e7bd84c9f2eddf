"""The operator's pure rendering: RLTrainingJob -> ConfigMap, RBAC and RayJob, and the patches for updates."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import yaml

from hybridflow.api import load_job
from hybridflow.api import pod as pod_api
from hybridflow.k8s import contract, names
from hybridflow.k8s.errors import RenderError
from hybridflow.k8s.patches import (
    layout_changed,
    merge_patch,
    owned_state,
    ownership_problem,
    rayjob_patch,
    restore_patch,
    stale_owner,
)
from hybridflow.k8s.pods import cpu_slots
from hybridflow.k8s.render import ENTRYPOINT, cluster_hash, render, render_children, render_manifests
from hybridflow.k8s.settings import DEFAULT_GPU_PRODUCTS, RenderSettings, SettingsError, parse_gpu_products
from hybridflow_operator.settings import from_env
from tests.helpers import env_of, kuberay_resources, reward_pool_graph, templates_of

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = RenderSettings()
UID = "0b6f1c9e-4a43-4f59-9d0e-6f1f3f0f2a11"


def example(name: str = "ppo-job.yaml") -> dict:
    return yaml.safe_load((ROOT / "examples" / name).read_text())


def live(job: dict, generation: int = 1) -> dict:
    """The job as the API server returns it: with a uid and a generation."""
    job = copy.deepcopy(job)
    job["metadata"].update(uid=UID, generation=generation, resourceVersion="1")
    return job


def by_kind(children: list[dict]) -> dict[str, dict]:
    return {c["kind"]: c for c in children}


def rayjob_of(job: dict, settings: RenderSettings = SETTINGS) -> dict:
    return by_kind(render_children(job, settings))["RayJob"]


def groups_of(rayjob: dict) -> dict[str, dict]:
    return {g["groupName"]: g for g in rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]}


def with_reward_pool(job: dict, *, reward_gpus: float = 0.0) -> dict:
    """A custom graph whose reward function runs in its own pool next to the actor."""
    job = copy.deepcopy(job)
    job["spec"]["graph"] = reward_pool_graph({"GPU": reward_gpus, "CPU": 4})
    job["spec"]["cluster"]["workerGroups"].append(
        {"name": "reward", "replicas": 1, "gpusPerWorker": 0, "cpusPerWorker": 16, "memory": "64Gi"})
    return job


# -- the children -------------------------------------------------------------------------------------


def test_renders_the_five_children_in_creation_order() -> None:
    kinds = [c["kind"] for c in render_children(example(), SETTINGS)]
    assert kinds == ["ConfigMap", "ServiceAccount", "Role", "RoleBinding", "RayJob"]


def test_every_child_is_labelled_and_owned_by_a_live_job() -> None:
    for child in render_children(live(example()), SETTINGS):
        meta = child["metadata"]
        assert meta["namespace"] == "default"
        assert meta["labels"][names.NAME_LABEL] == "hybridflow"
        assert meta["labels"][names.MANAGED_BY_LABEL] == "hybridflow-operator"
        assert meta["labels"][names.JOB_LABEL] == "qwen-gsm8k-ppo"
        assert meta["ownerReferences"] == [{
            "apiVersion": "hybridflow.io/v1alpha1", "kind": "RLTrainingJob", "name": "qwen-gsm8k-ppo",
            "uid": UID, "controller": True, "blockOwnerDeletion": True,
        }]


def test_a_job_from_a_file_has_no_owner_reference() -> None:
    assert all("ownerReferences" not in c["metadata"] for c in render_children(example(), SETTINGS))


def test_rendering_is_deterministic() -> None:
    assert render_manifests(live(example()), SETTINGS) == render_manifests(live(example()), SETTINGS)


def test_render_manifests_is_multi_document_yaml_of_the_children() -> None:
    docs = list(yaml.safe_load_all(render_manifests(example(), SETTINGS)))
    assert docs == render_children(example(), SETTINGS)


def test_role_lets_the_runtime_patch_only_its_jobs_status() -> None:
    children = by_kind(render_children(example(), SETTINGS))
    rules = children["Role"]["rules"]
    assert rules == [{"apiGroups": ["hybridflow.io"], "resources": ["rltrainingjobs/status"],
                      "resourceNames": ["qwen-gsm8k-ppo"], "verbs": ["patch"]}]
    binding = children["RoleBinding"]
    sa = children["ServiceAccount"]["metadata"]["name"]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": children["Role"]["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": "default"}]


def test_config_map_holds_the_job_with_the_resolved_graph() -> None:
    cm = by_kind(render_children(example(), SETTINGS))["ConfigMap"]
    doc = json.loads(cm["data"]["job.json"])
    assert doc["metadata"] == {"name": "qwen-gsm8k-ppo", "namespace": "default"}
    nodes = {n["name"]: n for n in doc["spec"]["graph"]["nodes"]}
    # 2 actor pods x 8 GPUs -> 16 actor instances; 1 critic pod x 8 GPUs -> 8 critic instances
    assert nodes["actor_rollout"]["parallelism"] == 16
    assert nodes["reference"]["parallelism"] == 16
    assert nodes["critic"]["parallelism"] == 8
    assert {n["pool"] for n in nodes.values()} == {"actor", "critic"}
    assert doc["spec"]["trainer"]["totalSteps"] == 500


def test_config_map_job_loads_with_the_api_models(tmp_path: Path) -> None:
    """The runtime reads the mounted file with the same models: the resolved graph must pass their
    validation, and a small float must come back a float (YAML 1.1 would read 1e-06 as a string)."""
    cm = by_kind(render_children(example(), SETTINGS))["ConfigMap"]
    mounted = tmp_path / "job.json"
    mounted.write_text(cm["data"]["job.json"])
    loaded = load_job(mounted)
    assert loaded.spec.graph is not None and len(loaded.spec.graph.nodes) == 4
    assert loaded.spec.trainer.actor_lr == 1e-06  # actorLr: 1.0e-6 in the example


def test_pods_mount_the_config_and_run_as_the_runtime_service_account() -> None:
    rayjob = rayjob_of(example())
    for template in templates_of(rayjob).values():
        assert template["spec"]["serviceAccountName"] == "qwen-gsm8k-ppo-runtime"
        volume = next(v for v in template["spec"]["volumes"] if "configMap" in v)
        assert volume["configMap"]["name"] == "qwen-gsm8k-ppo-config"
        mount = next(m for m in template["spec"]["containers"][0]["volumeMounts"] if m["name"] == volume["name"])
        assert mount["mountPath"] == "/etc/hybridflow"
        env = env_of(template)
        assert env["HYBRIDFLOW_JOB_NAME"] == "qwen-gsm8k-ppo"
        assert env["HYBRIDFLOW_JOB_NAMESPACE"] == "default"
        assert template["metadata"]["labels"][names.JOB_LABEL] == "qwen-gsm8k-ppo"


# -- names ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["a", "qwen-gsm8k-ppo", "x" * 47, "y" * 48, "z" * 63, "7b-ppo",
                                  "a" * 40 + "-" + "b" * 22])
def test_rayjob_names_fit_kuberay_and_are_dns1035(name: str) -> None:
    rj = names.rayjob_name(name)
    assert len(rj) <= names.MAX_RAYJOB_NAME
    assert rj[0].isalpha() and rj[-1].isalnum()
    assert all(c.isalnum() or c == "-" for c in rj)
    assert rj == names.rayjob_name(name)


def test_short_names_are_kept_and_long_ones_get_distinct_hashes() -> None:
    assert names.rayjob_name("qwen-gsm8k-ppo") == "qwen-gsm8k-ppo"
    a, b = names.rayjob_name("p" * 50 + "-one"), names.rayjob_name("p" * 50 + "-two")
    assert a != b and a[:30] == b[:30]


def test_long_job_name_renders_a_short_rayjob() -> None:
    job = example()
    job["metadata"]["name"] = "an-rl-post-training-job-with-a-very-long-descriptive-name"
    rayjob = rayjob_of(job)
    assert len(rayjob["metadata"]["name"]) <= 47
    assert rayjob["metadata"]["labels"][names.JOB_LABEL] == job["metadata"]["name"]


# -- the RayJob ------------------------------------------------------------------------------------------


def test_rayjob_spec_runs_the_trainer_and_shuts_down() -> None:
    spec = rayjob_of(example())["spec"]
    assert spec["entrypoint"] == ENTRYPOINT == "python -m hybridflow train --config /etc/hybridflow/job.json"
    assert spec["shutdownAfterJobFinishes"] is True
    assert spec["ttlSecondsAfterFinished"] == 3600
    assert spec["backoffLimit"] == 1
    assert spec["submissionMode"] == "K8sJobMode"
    assert spec["suspend"] is False
    assert "activeDeadlineSeconds" not in spec


def test_run_policy_and_submission_mode_reach_the_rayjob() -> None:
    job = example()
    job["spec"]["runPolicy"] = {"suspend": True, "backoffLimit": 3, "activeDeadlineSeconds": 7200,
                                "ttlSecondsAfterFinished": 60}
    job["spec"]["cluster"]["submissionMode"] = "HTTPMode"
    spec = rayjob_of(job)["spec"]
    assert (spec["suspend"], spec["backoffLimit"], spec["activeDeadlineSeconds"], spec["ttlSecondsAfterFinished"]) \
        == (True, 3, 7200, 60)
    assert spec["submissionMode"] == "HTTPMode"


def test_kueue_label_only_with_a_queue() -> None:
    assert names.QUEUE_LABEL not in rayjob_of(example())["metadata"]["labels"]
    job = example()
    job["spec"]["cluster"]["queueName"] = "gpu-team-a"
    assert rayjob_of(job)["metadata"]["labels"][names.QUEUE_LABEL] == "gpu-team-a"


def test_generation_annotation_records_what_was_rendered() -> None:
    assert rayjob_of(live(example(), generation=7))["metadata"]["annotations"][names.GENERATION_ANNOTATION] == "7"
    assert names.GENERATION_ANNOTATION not in rayjob_of(example())["metadata"]["annotations"]


def test_head_has_no_gpus_and_no_cpus_for_ray() -> None:
    head = rayjob_of(example())["spec"]["rayClusterSpec"]["headGroupSpec"]
    assert head["rayStartParams"] == {"num-cpus": "0", "dashboard-host": "0.0.0.0"}
    container = head["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in container["resources"]["limits"]
    assert env_of(head["template"])["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert {p["name"] for p in container["ports"]} >= {"dashboard", "gcs-server", "client"}
    assert "affinity" not in head["template"]["spec"]


def test_the_head_names_the_scheduler_dashboard_port_so_kuberay_exposes_it() -> None:
    """KubeRay builds its head Services' ports from the head container's ports, each under its name: the
    names must be unique valid port names (IANA_SVC_NAME), the numbers unique."""
    head = rayjob_of(example())["spec"]["rayClusterSpec"]["headGroupSpec"]
    ports = head["template"]["spec"]["containers"][0]["ports"]
    assert {"name": contract.DASHBOARD_PORT_NAME, "containerPort": contract.DASHBOARD_PORT} in ports
    port_names = [p["name"] for p in ports]
    assert len(set(port_names)) == len(port_names) and len({p["containerPort"] for p in ports}) == len(ports)
    for name in port_names:
        assert len(name) <= 15 and re.fullmatch(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?", name) and "--" not in name, name
        assert re.search("[a-z]", name), name
    longest = names.head_service_name(names.rayjob_name("x" * 253) + "-abcde")  # KubeRay's cluster name
    assert len(longest) <= 63 and longest.endswith("-head-svc")  # a Service name is a DNS-1035 label


def test_one_worker_group_per_pool_sized_from_the_spec() -> None:
    groups = groups_of(rayjob_of(example()))
    assert list(groups) == ["actor", "critic"]
    assert (groups["actor"]["replicas"], groups["actor"]["minReplicas"], groups["actor"]["maxReplicas"]) == (2, 2, 2)
    limits = groups["actor"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits == {"cpu": "64", "memory": "800Gi", "nvidia.com/gpu": "8"}


def test_gpu_groups_pin_the_product_tolerate_the_taint_and_request_what_they_limit() -> None:
    for group in groups_of(rayjob_of(example())).values():
        spec = group["template"]["spec"]
        term = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert term["nodeSelectorTerms"] == [{"matchExpressions": [{
            "key": "nvidia.com/gpu.product", "operator": "In",
            "values": ["NVIDIA-A100-SXM4-80GB", "NVIDIA-A100-80GB-PCIe"]}]}]
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
        resources = spec["containers"][0]["resources"]
        assert resources["limits"] == resources["requests"]


def test_gpu_groups_get_shm_of_spec_size_and_nccl_settings() -> None:
    job = example()
    job["spec"]["cluster"]["shmSize"] = "128Gi"
    job["spec"]["cluster"]["nccl"] = {"socketIfname": "eth0", "ibHca": "mlx5", "ibDisable": True, "debug": "INFO"}
    template = groups_of(rayjob_of(job))["actor"]["template"]
    shm = next(v for v in template["spec"]["volumes"] if "emptyDir" in v)
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "128Gi"}
    mount = next(m for m in template["spec"]["containers"][0]["volumeMounts"] if m["name"] == shm["name"])
    assert mount["mountPath"] == "/dev/shm"
    env = env_of(template)
    assert env["NCCL_CUMEM_ENABLE"] == "0"
    assert (env["NCCL_SOCKET_IFNAME"], env["NCCL_IB_HCA"], env["NCCL_IB_DISABLE"], env["NCCL_DEBUG"]) \
        == ("eth0", "mlx5", "1", "INFO")
    assert "NVIDIA_VISIBLE_DEVICES" not in env


def test_optional_nccl_settings_are_left_out_when_unset() -> None:
    job = example()
    del job["spec"]["cluster"]["nccl"]
    env = env_of(groups_of(rayjob_of(job))["actor"]["template"])
    assert env["NCCL_CUMEM_ENABLE"] == "0"
    assert not {"NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_IB_DISABLE", "NCCL_DEBUG"} & set(env)


def test_each_group_advertises_a_ray_resource_naming_its_pool() -> None:
    for name, group in groups_of(rayjob_of(example())).items():
        raw = group["rayStartParams"]["resources"]
        assert isinstance(raw, str)
        assert kuberay_resources(raw) == {f"pool_{name}": 8}


def test_spec_tolerations_and_node_selector_reach_every_pod() -> None:
    job = example()
    job["spec"]["cluster"]["tolerations"] = [{"key": "team", "operator": "Equal", "value": "rl",
                                              "effect": "NoSchedule"}]
    job["spec"]["cluster"]["nodeSelector"] = {"pool": "training"}
    rayjob = rayjob_of(job)
    for template in templates_of(rayjob).values():
        assert {"key": "team", "operator": "Equal", "value": "rl", "effect": "NoSchedule"} \
            in template["spec"]["tolerations"]
        assert template["spec"]["nodeSelector"] == {"pool": "training"}


def test_gpu_product_map_comes_from_the_settings() -> None:
    job = example()
    job["spec"]["cluster"]["gpuType"] = "MI300X"
    settings = RenderSettings(gpu_products={"MI300X": ("AMD-Instinct-MI300X",)})
    term = groups_of(rayjob_of(job, settings))["actor"]["template"]["spec"]["affinity"]["nodeAffinity"]
    values = term["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]["matchExpressions"][0]
    assert values["values"] == ["AMD-Instinct-MI300X"]


def test_image_from_spec_else_from_the_settings() -> None:
    def image(job: dict, settings: RenderSettings) -> str:
        head = rayjob_of(job, settings)["spec"]["rayClusterSpec"]["headGroupSpec"]
        return head["template"]["spec"]["containers"][0]["image"]

    assert image(example(), SETTINGS) == "docker.io/hybridflow/runtime:0.1.0"
    assert image(example(), RenderSettings(runtime_image="registry.local/rt:1")) == "registry.local/rt:1"
    job = example()
    job["spec"]["cluster"]["image"] = "my/image:2"
    assert image(job, SETTINGS) == "my/image:2"


def test_without_worker_groups_the_built_in_graph_gets_one_8_gpu_pod_per_pool() -> None:
    job = example()
    del job["spec"]["cluster"]["workerGroups"]
    groups = groups_of(rayjob_of(job))
    assert list(groups) == ["actor", "critic"]
    for group in groups.values():
        assert group["replicas"] == 1
        assert group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "8"


def test_min_and_max_replicas_of_the_rollout_group() -> None:
    job = example()
    job["spec"]["cluster"]["workerGroups"][0].update(minReplicas=1, maxReplicas=4)
    actor = groups_of(rayjob_of(job))["actor"]
    assert (actor["replicas"], actor["minReplicas"], actor["maxReplicas"]) == (2, 1, 4)
    assert render(job, SETTINGS).layout.rollout_group == "actor"


# -- co-location ----------------------------------------------------------------------------------------


def test_grpo_co_locates_actor_reference_and_reward_in_one_group() -> None:
    rendered = render(example("grpo-job.yaml"), SETTINGS)
    groups = groups_of(by_kind(rendered.children)["RayJob"])
    assert list(groups) == ["actor"]
    assert {n.pool for n in rendered.layout.graph.nodes} == {"actor"}
    assert "podAffinity" not in groups["actor"]["template"]["spec"]["affinity"]


def test_a_separate_reward_pool_runs_on_the_actor_nodes() -> None:
    groups = groups_of(rayjob_of(with_reward_pool(example())))
    assert list(groups) == ["actor", "critic", "reward"]
    spec = groups["reward"]["template"]["spec"]
    terms = spec["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms == [{
        "labelSelector": {"matchLabels": {names.JOB_LABEL: "qwen-gsm8k-ppo", "ray.io/group": "actor"}},
        "topologyKey": "kubernetes.io/hostname",
    }]
    # on GPU nodes, so it tolerates their taint, but it sees no GPU
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert env_of(groups["reward"]["template"])["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert "nvidia.com/gpu" not in spec["containers"][0]["resources"]["limits"]
    assert "nodeAffinity" not in spec["affinity"]
    for other in ("actor", "critic"):
        assert "podAffinity" not in groups[other]["template"]["spec"]["affinity"]


def test_custom_graph_keeps_its_parallelism() -> None:
    rendered = render(with_reward_pool(example()), SETTINGS)
    doc = json.loads(by_kind(rendered.children)["ConfigMap"]["data"]["job.json"])
    assert {n["name"]: n["parallelism"] for n in doc["spec"]["graph"]["nodes"]} \
        == {"actor": 16, "ref": 16, "score": 4, "critic": 8}


def test_custom_graph_without_groups_derives_them_from_pool_demand() -> None:
    job = with_reward_pool(example())
    del job["spec"]["cluster"]["workerGroups"]
    groups = groups_of(rayjob_of(job))
    gpus = {n: g["template"]["spec"]["containers"][0]["resources"]["limits"].get("nvidia.com/gpu")
            for n, g in groups.items()}
    assert gpus == {"actor": "8", "critic": "8", "reward": None}
    assert (groups["actor"]["replicas"], groups["critic"]["replicas"], groups["reward"]["replicas"]) == (2, 1, 1)
    assert groups["reward"]["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"] == "16"


def test_cpu_amounts_render_as_written_and_a_cpu_pool_gets_whole_slots() -> None:
    job = with_reward_pool(example())
    job["spec"]["cluster"]["headCpus"] = "250m"
    job["spec"]["cluster"]["workerGroups"][0]["cpusPerWorker"] = "500m"
    job["spec"]["cluster"]["workerGroups"][2]["cpusPerWorker"] = "1.5"
    rayjob = rayjob_of(job)
    head = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert head["resources"] == {"requests": {"cpu": "250m", "memory": "32Gi"},
                                 "limits": {"cpu": "250m", "memory": "32Gi"}}
    groups = groups_of(rayjob)
    assert groups["actor"]["template"]["spec"]["containers"][0]["resources"]["requests"]["cpu"] == "500m"
    reward = groups["reward"]["template"]["spec"]["containers"][0]["resources"]
    assert reward["requests"]["cpu"] == reward["limits"]["cpu"] == "1.5"
    # 1.5 cores: 2 slots, the CPUs Ray counts on the pod (KubeRay rounds the limit up for num-cpus)
    assert kuberay_resources(groups["reward"]["rayStartParams"]["resources"]) == {
        contract.pool_resource("reward"): 2}
    # a GPU group's slots are its GPUs, whatever its CPUs
    assert kuberay_resources(groups["actor"]["rayStartParams"]["resources"]) == {
        contract.pool_resource("actor"): 8}


@pytest.mark.parametrize(("cpus", "slots"), [(1, 1), (16, 16), ("16", 16), ("1.5", 2), ("500m", 1), ("1m", 1),
                                             ("2000m", 2), ("2001m", 3)])
def test_cpu_slots_round_cores_up(cpus: int | str, slots: int) -> None:
    assert cpu_slots(cpus) == slots


# -- errors the CRD cannot catch ---------------------------------------------------------------------------


def render_error(job: dict, settings: RenderSettings = SETTINGS) -> RenderError:
    with pytest.raises(RenderError) as info:
        render_children(job, settings)
    return info.value


def test_unknown_gpu_type_names_the_field_and_the_known_types() -> None:
    job = example()
    job["spec"]["cluster"]["gpuType"] = "V100-16GB"
    err = render_error(job)
    assert (err.field, err.reason) == ("spec.cluster.gpuType", "UnknownGPUType")
    assert "V100-16GB" in err.message and "A100-80GB" in err.message


def test_graph_needing_more_gpus_than_the_groups_hold() -> None:
    job = with_reward_pool(example())
    job["spec"]["graph"]["nodes"][0]["parallelism"] = 24  # 24 GPUs, the actor group holds 16
    job["spec"]["graph"]["nodes"][1]["parallelism"] = 24
    err = render_error(job)
    assert (err.field, err.reason) == ("spec.cluster.workerGroups[0]", "InsufficientGPUs")
    assert "24" in err.message and "16" in err.message


def test_an_instance_larger_than_a_pod() -> None:
    job = with_reward_pool(example())
    job["spec"]["graph"]["nodes"][3]["resources"] = {"GPU": 16}
    job["spec"]["graph"]["nodes"][3]["parallelism"] = 1
    err = render_error(job)
    assert err.reason == "InsufficientGPUs" and "a pod of worker group 'critic' has 8" in err.message


def test_missing_worker_group_for_a_pool() -> None:
    job = example()
    job["spec"]["cluster"]["workerGroups"] = job["spec"]["cluster"]["workerGroups"][:1]
    err = render_error(job)
    assert (err.field, err.reason) == ("spec.cluster.workerGroups", "MissingWorkerGroup")
    assert "'critic'" in err.message


def test_worker_group_for_no_pool() -> None:
    job = example("grpo-job.yaml")
    job["spec"]["cluster"]["workerGroups"].append({"name": "critic", "replicas": 1})
    err = render_error(job)
    assert (err.field, err.reason) == ("spec.cluster.workerGroups[1].name", "UnknownWorkerGroup")


def test_built_in_graph_on_a_group_without_gpus() -> None:
    job = example("grpo-job.yaml")
    job["spec"]["cluster"]["workerGroups"][0]["gpusPerWorker"] = 0
    job["spec"]["rollout"]["engine"] = "torch"  # vllm without a GPU group is the spec's own refusal
    err = render_error(job)
    assert (err.field, err.reason) == ("spec.cluster.workerGroups[0]", "InsufficientGPUs")
    job["spec"]["rollout"]["engine"] = "vllm"
    assert "rollout.engine vllm runs on GPUs" in render_error(job).message


def test_invalid_graph_is_a_render_error() -> None:
    job = with_reward_pool(example())
    nodes = [n["name"] for n in job["spec"]["graph"]["nodes"]]
    job["spec"]["graph"]["edges"] += [{"src": nodes[0], "dst": nodes[1]}, {"src": nodes[1], "dst": nodes[0]}]
    err = render_error(job)
    assert (err.field, err.reason) == ("spec.graph", "InvalidGraph")
    assert "cycle" in err.message


def test_an_edge_to_no_node_is_refused_by_the_spec_as_by_the_api_server() -> None:
    job = with_reward_pool(example())
    job["spec"]["graph"]["edges"].append({"src": "critic", "dst": "nowhere"})
    err = render_error(job)
    assert err.reason == "InvalidSpec"
    assert "spec.graph.edges: edges[" in err.message and "'nowhere' is not a node in graph.nodes" in err.message


def test_replicas_outside_min_and_max() -> None:
    job = example()
    job["spec"]["cluster"]["workerGroups"][0].update(minReplicas=3, maxReplicas=4)
    err = render_error(job)
    assert err.reason == "InvalidSpec"
    assert "spec.cluster.workerGroups[0]: minReplicas must be at most replicas" in err.message


def ppo_without_reward() -> dict:
    """A PPO job whose graph passes the structural rules but has no reward node: it cannot train."""
    job = example()
    job["spec"]["graph"] = {
        "nodes": [{"name": "actor", "role": "actor_rollout", "resources": {"GPU": 1}, "pool": "actor"},
                  {"name": "critic", "role": "critic", "resources": {"GPU": 1}, "pool": "critic"}],
        "edges": [{"src": "actor", "dst": "critic", "dataType": "rollout_batch"},
                  {"src": "critic", "dst": "actor", "dataType": "updated_policy", "control": True}],
    }
    return job


def test_a_graph_that_cannot_train_is_a_render_error_on_spec_graph() -> None:
    error = render_error(ppo_without_reward())
    assert (error.field, error.reason) == ("spec.graph", "InvalidGraph")
    assert "ppo needs a node with role reward" in error.message
    assert not error.message.startswith("spec.graph: ")  # the field is said once, by the condition


def test_each_training_rule_is_a_render_error_on_spec_graph(broken) -> None:
    doc, needle = broken
    error = render_error(doc)
    assert (error.field, error.reason) == ("spec.graph", "InvalidGraph")
    assert needle.removeprefix("spec.graph: ") in error.message, error.message


def test_spec_the_api_models_reject_is_a_render_error() -> None:
    job = example()
    job["spec"]["algorithm"]["name"] = "dpo"
    err = render_error(job)
    assert (err.field, err.reason) == ("spec", "InvalidSpec")
    assert "algorithm.name" in err.message


# -- patches for existing children ---------------------------------------------------------------------------


def test_identical_rayjob_needs_no_patch() -> None:
    desired = rayjob_of(live(example()))
    assert rayjob_patch(desired, desired, "actor") == []


def test_allowed_changes_become_json_patch_ops() -> None:
    existing = rayjob_of(live(example(), generation=1))
    job = live(example(), generation=2)
    job["spec"]["runPolicy"].update(suspend=True, ttlSecondsAfterFinished=60, activeDeadlineSeconds=600)
    job["spec"]["cluster"]["workerGroups"][0].update(replicas=3, maxReplicas=4)
    rendered = render(job, SETTINGS)
    ops = rayjob_patch(existing, by_kind(rendered.children)["RayJob"], rendered.layout.rollout_group)
    assert {"op": "add", "path": "/spec/suspend", "value": True} in ops
    assert {"op": "add", "path": "/spec/ttlSecondsAfterFinished", "value": 60} in ops
    assert {"op": "add", "path": "/spec/activeDeadlineSeconds", "value": 600} in ops
    assert {"op": "test", "path": "/spec/rayClusterSpec/workerGroupSpecs/0/groupName", "value": "actor"} in ops
    assert {"op": "add", "path": "/spec/rayClusterSpec/workerGroupSpecs/0/replicas", "value": 3} in ops
    assert {"op": "add", "path": "/spec/rayClusterSpec/workerGroupSpecs/0/maxReplicas", "value": 4} in ops
    assert {"op": "add", "path": "/metadata/annotations/hybridflow.io~1generation", "value": "2"} in ops
    assert not any("workerGroupSpecs/1" in op["path"] for op in ops)  # the critic group is not elastic


def test_only_what_nobody_else_sets_is_restored_between_generations() -> None:
    desired = rayjob_of(live(example()))
    drifted = copy.deepcopy(desired)
    drifted["spec"].update(suspend=True, ttlSecondsAfterFinished=5, activeDeadlineSeconds=60)  # Kueue; a user
    drifted["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicas"] = 7
    drifted["metadata"]["labels"][names.JOB_LABEL] = "other"
    drifted["metadata"]["labels"]["team"] = "a"
    ops = restore_patch(drifted, desired)
    assert sorted(ops, key=lambda op: op["path"]) == [
        {"op": "add", "path": "/metadata/labels/hybridflow.io~1job", "value": "qwen-gsm8k-ppo"},
        {"op": "remove", "path": "/spec/activeDeadlineSeconds"},
        {"op": "add", "path": "/spec/ttlSecondsAfterFinished", "value": desired["spec"]["ttlSecondsAfterFinished"]},
    ]
    assert restore_patch(desired, desired) == []
    assert owned_state(drifted) != owned_state(desired)
    kueue_only = copy.deepcopy(desired)
    kueue_only["spec"]["suspend"] = True
    assert owned_state(kueue_only) == owned_state(desired)
    no_labels = copy.deepcopy(desired)
    del no_labels["metadata"]["labels"]
    assert restore_patch(no_labels, desired) == [
        {"op": "add", "path": "/metadata/labels", "value": names.labels("qwen-gsm8k-ppo")}]


def test_removing_the_deadline_removes_it() -> None:
    job = live(example())
    job["spec"]["runPolicy"]["activeDeadlineSeconds"] = 600
    existing = rayjob_of(job)
    ops = rayjob_patch(existing, rayjob_of(live(example(), generation=2)), "actor")
    assert {"op": "remove", "path": "/spec/activeDeadlineSeconds"} in ops


def test_layout_change_is_detected_but_replicas_of_the_rollout_group_are_not_one() -> None:
    existing = rayjob_of(live(example()))
    scaled = live(example(), generation=2)
    scaled["spec"]["cluster"]["workerGroups"][0]["replicas"] = 1
    assert not layout_changed(existing, rayjob_of(scaled))
    resized = live(example(), generation=2)
    resized["spec"]["cluster"]["workerGroups"][1]["replicas"] = 2
    assert layout_changed(existing, rayjob_of(resized))


def test_config_map_and_role_are_replaced_by_their_desired_content() -> None:
    old = by_kind(render_children(live(example()), SETTINGS))
    job = live(example(), generation=2)
    job["spec"]["trainer"]["totalSteps"] = 10
    new = by_kind(render_children(job, SETTINGS))
    assert merge_patch(old["ConfigMap"], new["ConfigMap"]) == {"data": new["ConfigMap"]["data"]}
    assert merge_patch(old["Role"], new["Role"]) is None
    assert merge_patch(old["ServiceAccount"], new["ServiceAccount"]) is None


def test_ownership_of_existing_children() -> None:
    child = by_kind(render_children(live(example()), SETTINGS))["ConfigMap"]
    owner = child["metadata"]["ownerReferences"][0]
    assert ownership_problem(child, owner) is None
    foreign = copy.deepcopy(child)
    del foreign["metadata"]["ownerReferences"]
    assert "not owned" in ownership_problem(foreign, owner)
    previous = copy.deepcopy(child)
    previous["metadata"]["ownerReferences"][0]["uid"] = "an-earlier-job"
    assert ownership_problem(previous, owner) and stale_owner(previous, owner)
    assert not stale_owner(foreign, owner)


# -- settings ---------------------------------------------------------------------------------------------------


def test_settings_defaults() -> None:
    s = from_env({})
    assert s.clusterwide and s.watch_namespaces == ()
    assert s.render.runtime_image == "docker.io/hybridflow/runtime:0.1.0"
    assert s.render.gpu_products["A100-80GB"] == ("NVIDIA-A100-SXM4-80GB", "NVIDIA-A100-80GB-PCIe")
    assert {"A100-40GB", "H100-80GB", "H200-141GB", "L40S", "A10G"} <= set(s.render.gpu_products)


def test_settings_from_env() -> None:
    s = from_env({
        "HYBRIDFLOW_WATCH_NAMESPACES": "team-a, team-b,,team-a",
        "HYBRIDFLOW_LOG_LEVEL": "debug",
        "HYBRIDFLOW_GPU_PRODUCTS": "A100-80GB: [NVIDIA-A100-SXM4-80GB]\nL4: NVIDIA-L4\n",
        "HYBRIDFLOW_RUNTIME_IMAGE": "registry.local/rt:2",
        "HYBRIDFLOW_STATUS_INTERVAL": "60",
        "HYBRIDFLOW_STATUS_MIN_INTERVAL": "0.5",
        "HYBRIDFLOW_STATUS_WRITES_PER_S": "50",
        "HYBRIDFLOW_MAX_REQUESTS": "16",
        "HYBRIDFLOW_SPIN_UP_JOBS": "25",
        "HYBRIDFLOW_PROGRESS_INTERVAL": "2.5",
    })
    assert s.watch_namespaces == ("team-a", "team-b") and not s.clusterwide
    assert s.log_level == "DEBUG"
    assert dict(s.render.gpu_products) == {"A100-80GB": ("NVIDIA-A100-SXM4-80GB",), "L4": ("NVIDIA-L4",)}
    assert s.render.runtime_image == "registry.local/rt:2"
    assert s.status_interval == 60.0
    assert (s.status_min_interval, s.status_writes_per_s, s.max_requests, s.spin_up_jobs) == (0.5, 50.0, 16, 25)
    assert s.render.progress_interval == 2.5 and from_env({}).render.progress_interval == 5.0


def test_render_settings_read_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYBRIDFLOW_RUNTIME_IMAGE", "registry.local/rt:3")
    assert RenderSettings.from_env().runtime_image == "registry.local/rt:3"


def test_flags_override_env() -> None:
    s = from_env({"HYBRIDFLOW_LOG_LEVEL": "ERROR"}, log_level="WARNING", event_level=None)
    assert s.log_level == "WARNING" and s.event_level == "INFO"


def test_gpu_products_accept_json() -> None:
    assert parse_gpu_products('{"H100-80GB": ["NVIDIA-H100-80GB-HBM3"]}') == {"H100-80GB": ("NVIDIA-H100-80GB-HBM3",)}


@pytest.mark.parametrize("env", [
    {"HYBRIDFLOW_GPU_PRODUCTS": "[a, b]"},
    {"HYBRIDFLOW_GPU_PRODUCTS": "A100: []"},
    {"HYBRIDFLOW_GPU_PRODUCTS": "{unclosed"},
    {"HYBRIDFLOW_LOG_LEVEL": "LOUD"},
    {"HYBRIDFLOW_STATUS_INTERVAL": "-1"},
    {"HYBRIDFLOW_STATUS_WRITES_PER_S": "0"},
    {"HYBRIDFLOW_MAX_REQUESTS": "many"},
])
def test_bad_settings_are_refused(env: dict[str, str]) -> None:
    with pytest.raises(SettingsError):
        from_env(env)


@pytest.mark.parametrize("name", ["HYBRIDFLOW_PROGRESS_INTERVAL", "HYBRIDFLOW_STATUS_INTERVAL",
                                  "HYBRIDFLOW_STATUS_WRITES_PER_S", "HYBRIDFLOW_MAX_REQUESTS"])
@pytest.mark.parametrize("value", ["0", "-1", "5s", "inf", "nan"])
def test_a_number_setting_that_is_not_a_positive_number_is_named_with_its_value(name: str, value: str) -> None:
    with pytest.raises(SettingsError) as refused:
        from_env({name: value})
    assert str(refused.value) == f"{name} must be a positive number, got {value!r}"


def test_default_gpu_map_is_read_only() -> None:
    with pytest.raises(TypeError):
        DEFAULT_GPU_PRODUCTS["X"] = ("Y",)  # type: ignore[index]


def test_every_runtime_variable_set_in_a_pod_is_one_the_runtime_reads() -> None:
    for template in templates_of(rayjob_of(live(example()))).values():
        env = env_of(template)
        ours = {k for k in env if k.startswith("HYBRIDFLOW_")}
        assert ours == {contract.ENV_JOB_NAME, contract.ENV_JOB_NAMESPACE, contract.ENV_CONFIG,
                        contract.ENV_PROGRESS_INTERVAL}
        assert env[contract.ENV_CONFIG] == contract.CONFIG_PATH
        assert env[contract.ENV_PROGRESS_INTERVAL] == "5"


def test_the_operators_progress_interval_reaches_every_ray_pod() -> None:
    """The interval is the operator's setting (the chart's progressInterval), not the job's: the head, where the
    driver reports, and every worker group carry it."""
    settings = RenderSettings.from_env({contract.ENV_PROGRESS_INTERVAL: "0.5"})
    templates = templates_of(rayjob_of(live(example()), settings))
    assert {group: env_of(t)[contract.ENV_PROGRESS_INTERVAL] for group, t in templates.items()} == \
        dict.fromkeys(templates, "0.5")


# -- pod settings of spec.cluster ---------------------------------------------------------------------------


POD_SETTINGS = {
    "envFrom": [{"configMapRef": {"name": "training-env"}}],
    "imagePullSecrets": [{"name": "registry-creds"}],
    "podLabels": {"cost-center": "research", "team": "rl-infra"},
    "podAnnotations": {"cluster-autoscaler.kubernetes.io/safe-to-evict": "false"},
    "priorityClassName": "training",
    "serviceAccount": {"annotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::123456789012:role/trainer"}},
}


def with_pod_settings(job: dict) -> dict:
    """The example (PVC mounts and HF_TOKEN already in it) with every other pod setting, and a CPU-only group."""
    job = with_reward_pool(job)
    job["spec"]["cluster"].update(copy.deepcopy(POD_SETTINGS))
    return job


def test_pod_settings_reach_the_head_and_every_worker_group() -> None:
    job = with_pod_settings(example())
    cluster = job["spec"]["cluster"]
    templates = templates_of(rayjob_of(job))
    assert list(templates) == ["head", "actor", "critic", "reward"]
    for name, template in templates.items():
        spec, container = template["spec"], template["spec"]["containers"][0]
        for volume in cluster["volumes"]:
            assert volume in spec["volumes"], name
        for mount in cluster["volumeMounts"]:
            assert mount in container["volumeMounts"], name
        assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}} \
            in container["env"], name
        assert container["envFrom"] == [{"configMapRef": {"name": "training-env"}}], name
        assert spec["imagePullSecrets"] == [{"name": "registry-creds"}], name
        assert spec["priorityClassName"] == "training", name
        assert template["metadata"]["annotations"] == {"cluster-autoscaler.kubernetes.io/safe-to-evict": "false"}
        assert template["metadata"]["labels"]["cost-center"] == "research", name
        assert template["metadata"]["labels"]["team"] == "rl-infra", name  # podLabels over the job's labels


def test_the_operators_own_settings_come_first_and_stay() -> None:
    """The user's variables follow the operator's (so they may reference them); its volumes stay in place."""
    for name, template in templates_of(rayjob_of(with_pod_settings(example()))).items():
        container = template["spec"]["containers"][0]
        env = [e["name"] for e in container["env"]]
        assert env.index("HF_TOKEN") > max(i for i, n in enumerate(env) if n.startswith("HYBRIDFLOW_")), name
        assert container["volumeMounts"][0]["mountPath"] == contract.CONFIG_DIR, name
        assert template["spec"]["volumes"][0]["configMap"]["name"] == "qwen-gsm8k-ppo-config", name
        labels = template["metadata"]["labels"]
        assert labels[names.JOB_LABEL] == "qwen-gsm8k-ppo" and labels[names.MANAGED_BY_LABEL] == "hybridflow-operator"


def test_without_pod_settings_the_pods_have_none_of_them() -> None:
    job = example()
    for key in ("volumes", "volumeMounts", "env"):
        del job["spec"]["cluster"][key]
    for template in templates_of(rayjob_of(job)).values():
        assert not {"imagePullSecrets", "priorityClassName"} & set(template["spec"])
        assert "annotations" not in template["metadata"]
        assert "envFrom" not in template["spec"]["containers"][0]
        assert all(v["name"] in ("hybridflow-config", "dshm") for v in template["spec"]["volumes"])
    assert "annotations" not in by_kind(render_children(job, SETTINGS))["ServiceAccount"]["metadata"]


def test_the_submitter_pod_gets_the_pod_settings_of_the_job() -> None:
    """KubeRay's default submitter pod has none of the head's settings: without the pull secrets a private image
    would not pull, without the tolerations it may find no node, without the variables and mounts an image that
    needs them would not find `ray`. In K8sJobMode the RayJob names its own."""
    job = with_pod_settings(example())
    cluster = job["spec"]["cluster"]
    cluster["image"] = "registry.example.com/rt:1"
    cluster["tolerations"] = [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}]
    cluster["nodeSelector"] = {"pool": "training"}
    spec = rayjob_of(job)["spec"]["submitterPodTemplate"]["spec"]
    assert spec["imagePullSecrets"] == [{"name": "registry-creds"}]
    assert spec["restartPolicy"] == "Never" and spec["priorityClassName"] == "training"
    assert spec["tolerations"] == cluster["tolerations"]  # not the GPU taint: it runs no GPU work
    assert spec["nodeSelector"] == {"pool": "training"}
    assert spec["volumes"] == cluster["volumes"]
    (container,) = spec["containers"]
    assert container["image"] == "registry.example.com/rt:1" and "command" not in container  # KubeRay's command
    assert container["volumeMounts"] == cluster["volumeMounts"]
    assert container["envFrom"] == [{"configMapRef": {"name": "training-env"}}]
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}} in container["env"]
    job["spec"]["cluster"]["submissionMode"] = "HTTPMode"
    assert "submitterPodTemplate" not in rayjob_of(job)["spec"]


def test_without_pod_settings_kuberays_default_submitter_runs() -> None:
    job = example()
    for key in ("volumes", "volumeMounts", "env", "envFrom", "imagePullSecrets", "tolerations", "nodeSelector"):
        job["spec"]["cluster"].pop(key, None)
    assert "submitterPodTemplate" not in rayjob_of(job)["spec"]


def test_the_runtime_service_account_carries_the_workload_identity_annotations() -> None:
    children = by_kind(render_children(with_pod_settings(example()), SETTINGS))
    sa = children["ServiceAccount"]
    assert sa["metadata"]["annotations"] == {"eks.amazonaws.com/role-arn": "arn:aws:iam::123456789012:role/trainer"}
    for template in templates_of(children["RayJob"]).values():
        assert template["spec"]["serviceAccountName"] == sa["metadata"]["name"]


JOB_LABELS = {
    "team": "post-training",
    "example.com/tier": "gold",
    "kueue.x-k8s.io/priority-class": "high",
    "kueue.x-k8s.io/queue-name": "not-this-way",
    "app.kubernetes.io/instance": "argo-app",
    "argocd.argoproj.io/instance": "argo-app",
    "kustomize.toolkit.fluxcd.io/name": "flux-ks",
    "helm.sh/chart": "x-1.0",
    "node.kubernetes.io/instance-type": "a2",
    "k8s.io/x": "y",
    "hybridflow.io/job": "someone-else",
    "ray.io/cluster": "someone-else",
}


def test_job_labels_reach_the_rayjob_and_pods_minus_reserved_domains() -> None:
    job = example()
    job["metadata"]["labels"] = dict(JOB_LABELS)
    job["spec"]["cluster"]["queueName"] = "gpu-team-a"
    rayjob = rayjob_of(job)
    labels = rayjob["metadata"]["labels"]
    assert {k: v for k, v in labels.items() if k in JOB_LABELS or k == names.QUEUE_LABEL} == {
        "team": "post-training",
        "example.com/tier": "gold",
        "kueue.x-k8s.io/priority-class": "high",  # Kueue reads a workload's priority here
        names.QUEUE_LABEL: "gpu-team-a",  # from spec.cluster.queueName, not from the job's labels
        names.JOB_LABEL: "qwen-gsm8k-ppo",  # the operator's own, not the job's label of that name
    }
    for name, template in templates_of(rayjob).items():
        pod = template["metadata"]["labels"]
        assert {k: v for k, v in pod.items() if k in JOB_LABELS} == {
            "team": "post-training", "example.com/tier": "gold", names.JOB_LABEL: "qwen-gsm8k-ppo"}, name
        assert names.QUEUE_LABEL not in pod and "ray.io/cluster" not in pod


def test_one_rule_keeps_reserved_domains_from_labels_and_annotations() -> None:
    metadata = {
        "a": "1",
        "team.example.com/b": "2",
        "notkubernetes.io/c": "3",  # a domain that merely ends like a reserved one
        "kubernetes.io/d": "4",
        "x.kubernetes.io/e": "5",
        "kubectl.kubernetes.io/last-applied-configuration": "{}",
        "kopf.zalando.org/last-handled-configuration": "{}",
        "argocd.argoproj.io/tracking-id": "app:hybridflow.io/RLTrainingJob:default/x",
        "kustomize.toolkit.fluxcd.io/name": "flux-ks",
        "meta.helm.sh/release-name": "training",
        "kapp.k14s.io/app": "1700000000",
        "kueue.x-k8s.io/priority-class": "p",
    }
    assert names.propagated(metadata) == {"a": "1", "team.example.com/b": "2", "notkubernetes.io/c": "3"}
    assert names.propagated(metadata, passthrough=(names.PRIORITY_CLASS_LABEL,)) == {
        "a": "1", "team.example.com/b": "2", "notkubernetes.io/c": "3", "kueue.x-k8s.io/priority-class": "p"}


def test_pod_labels_never_override_the_operators() -> None:
    job = example()
    job["spec"]["cluster"]["podLabels"] = {names.MANAGED_BY_LABEL: "me", "team": "a"}
    for template in templates_of(rayjob_of(job)).values():
        labels = template["metadata"]["labels"]
        assert labels[names.JOB_LABEL] == "qwen-gsm8k-ppo" and labels[names.MANAGED_BY_LABEL] == "hybridflow-operator"
        assert labels["team"] == "a"


def test_ray_pods_leave_app_name_to_kuberay_whatever_the_job_says() -> None:
    """KubeRay's head Services select the head by app.kubernetes.io/name: kuberay, the value KubeRay gives its
    pods when the template has none: `<rayJob>-head-svc` (kubectl ray session, port-forwards) needs it."""
    job = example()
    job["metadata"]["labels"] = {"app.kubernetes.io/name": "from-job"}
    job["spec"]["cluster"]["podLabels"] = {"app.kubernetes.io/name": "mine"}
    for template in templates_of(rayjob_of(job)).values():
        assert names.NAME_LABEL not in template["metadata"]["labels"]


JOB_ANNOTATIONS = {
    "description": "nightly GSM8K run",
    "team.example.com/owner": "rl-infra",
    "kubectl.kubernetes.io/last-applied-configuration": '{"apiVersion":"hybridflow.io/v1alpha1"}',
    "deployment.kubernetes.io/revision": "3",
    "cluster-autoscaler.kubernetes.io/safe-to-evict": "true",
    "kopf.zalando.org/last-handled-configuration": "{}",
    "argocd.argoproj.io/tracking-id": "rl:hybridflow.io/RLTrainingJob:default/qwen-gsm8k-ppo",
    "argocd.argoproj.io/sync-wave": "1",
    "kustomize.toolkit.fluxcd.io/checksum": "0123abcd",
    "meta.helm.sh/release-name": "training",
    "kapp.k14s.io/identity": "v1;default/hybridflow.io/RLTrainingJob/qwen-gsm8k-ppo;hybridflow.io/v1alpha1",
    "provreq.kueue.x-k8s.io/maxRunDurationSeconds": "3600",
    "hybridflow.io/generation": "99",
    "hybridflow.io/cluster-hash": "forged",
    "ray.io/ft-enabled": "true",
}
PROPAGATED_ANNOTATIONS = {"description": "nightly GSM8K run", "team.example.com/owner": "rl-infra"}


def test_job_annotations_reach_the_rayjob_and_pods_minus_reserved_domains() -> None:
    job = live(example(), generation=7)
    job["metadata"]["annotations"] = dict(JOB_ANNOTATIONS)
    rendered = render(job, SETTINGS)
    rayjob = by_kind(rendered.children)["RayJob"]
    assert rayjob["metadata"]["annotations"] == {
        **PROPAGATED_ANNOTATIONS,
        names.CLUSTER_HASH_ANNOTATION: cluster_hash(rayjob, rendered.layout.rollout_group),  # not "forged"
        names.GENERATION_ANNOTATION: "7",  # the operator's, not the job's "99"
    }
    for name, template in templates_of(rayjob).items():
        assert template["metadata"]["annotations"] == PROPAGATED_ANNOTATIONS, name
    for child in rendered.children:
        if child["kind"] != "RayJob":
            assert "annotations" not in child["metadata"], child["kind"]  # RayJob and pods only


def test_pod_annotations_win_over_the_jobs_on_the_pods_only() -> None:
    job = example()
    job["metadata"]["annotations"] = {"team.example.com/owner": "from-the-job", "description": "from the job"}
    job["spec"]["cluster"]["podAnnotations"] = {
        "team.example.com/owner": "from-pod-annotations",
        "cluster-autoscaler.kubernetes.io/safe-to-evict": "false",  # a reserved domain, set explicitly
    }
    rayjob = rayjob_of(job)
    assert {k: v for k, v in rayjob["metadata"]["annotations"].items() if not k.startswith("hybridflow.io/")} \
        == {"team.example.com/owner": "from-the-job", "description": "from the job"}
    for name, template in templates_of(rayjob).items():
        assert template["metadata"]["annotations"] == {
            "team.example.com/owner": "from-pod-annotations",
            "description": "from the job",
            "cluster-autoscaler.kubernetes.io/safe-to-evict": "false",
        }, name


TRACKING_LABELS = {
    "app.kubernetes.io/instance": "rl-apps",  # Argo CD's default tracking label
    "argocd.argoproj.io/instance": "rl-apps",
    "kustomize.toolkit.fluxcd.io/name": "rl-apps",
    "kustomize.toolkit.fluxcd.io/namespace": "flux-system",
    "helm.toolkit.fluxcd.io/name": "rl-apps",
    "app.kubernetes.io/managed-by": "Helm",
    "kapp.k14s.io/app": "1700000000",
}
TRACKING_ANNOTATIONS = {
    "argocd.argoproj.io/tracking-id": "rl-apps:hybridflow.io/RLTrainingJob:default/qwen-gsm8k-ppo",
    "argocd.argoproj.io/compare-options": "IgnoreExtraneous",
    "argocd.argoproj.io/sync-options": "Prune=false",
    "kustomize.toolkit.fluxcd.io/reconcile": "disabled",
    "meta.helm.sh/release-name": "rl-apps",
    "meta.helm.sh/release-namespace": "default",
}


def metadata_maps(obj: object, kind: str) -> list[dict]:
    """Every `labels` or `annotations` map (`kind`) anywhere in a rendered object, pod templates included."""
    if isinstance(obj, dict):
        found = [obj[kind]] if isinstance(obj.get(kind), dict) else []
        return found + [m for v in obj.values() for m in metadata_maps(v, kind)]
    if isinstance(obj, list):
        return [m for v in obj for m in metadata_maps(v, kind)]
    return []


def test_gitops_tracking_labels_and_annotations_stay_on_the_job() -> None:
    """Argo CD, Flux, Helm and kapp find what they own by these: on the RayJob or its pods they would take them
    for objects of their own that are not in Git, and show them out of sync or prune them."""
    job = with_pod_settings(example())  # a submitter pod template too
    job["metadata"]["labels"] = {**TRACKING_LABELS, "team": "post-training"}
    job["metadata"]["annotations"] = {**TRACKING_ANNOTATIONS, "description": "kept"}
    children = render_children(job, SETTINGS)
    assert "submitterPodTemplate" in by_kind(children)["RayJob"]["spec"]
    for child in children:
        for labels in metadata_maps(child, "labels"):
            assert not {k for k, v in labels.items() if TRACKING_LABELS.get(k) == v}, labels  # managed-by is ours
        for notes in metadata_maps(child, "annotations"):
            assert not set(TRACKING_ANNOTATIONS) & set(notes), notes
    rayjob = by_kind(children)["RayJob"]
    assert rayjob["metadata"]["labels"]["team"] == "post-training"
    assert rayjob["metadata"]["annotations"]["description"] == "kept"


def test_pod_settings_are_part_of_the_cluster_hash() -> None:
    """KubeRay ignores them on a running cluster, so a change to them is reported as an ignored layout change."""
    existing = rayjob_of(live(example()))
    changed = live(example(), generation=2)
    changed["spec"]["cluster"]["volumeMounts"][0]["mountPath"] = "/models"
    assert layout_changed(existing, rayjob_of(changed))


def test_every_volume_mount_and_variable_the_operator_sets_is_reserved_in_the_api() -> None:
    """The API refuses the names the operator uses itself (hybridflow.api.pod keeps the list, apart from
    hybridflow.k8s): render a job with all of them and check each one against the API's rules."""
    job = with_reward_pool(example())
    for key in ("volumes", "volumeMounts", "env"):
        del job["spec"]["cluster"][key]
    job["spec"]["cluster"]["nccl"] = {"socketIfname": "eth0", "ibHca": "mlx5", "ibDisable": True, "debug": "INFO"}
    seen_env: set[str] = set()
    for template in templates_of(rayjob_of(job)).values():
        for volume in template["spec"]["volumes"]:
            assert volume["name"] in pod_api.OPERATOR_VOLUMES
        for mount in template["spec"]["containers"][0]["volumeMounts"]:
            assert pod_api.mount_path_problem(mount["mountPath"]) is not None, mount
        for env in template["spec"]["containers"][0]["env"]:
            assert pod_api.env_name_problem(env["name"]) is not None, env
            seen_env.add(env["name"])
    assert {"NVIDIA_VISIBLE_DEVICES", "NCCL_CUMEM_ENABLE", "NCCL_SOCKET_IFNAME", contract.ENV_CONFIG} <= seen_env


def test_service_account_annotations_are_patched_in_but_never_removed() -> None:
    old = by_kind(render_children(live(example()), SETTINGS))["ServiceAccount"]
    old["metadata"]["annotations"] = {"someone.example.com/else": "x"}
    job = live(with_pod_settings(example()), generation=2)
    new = by_kind(render_children(job, SETTINGS))["ServiceAccount"]
    assert merge_patch(old, new) == {"metadata": {"annotations": POD_SETTINGS["serviceAccount"]["annotations"]}}
    old["metadata"]["annotations"].update(new["metadata"]["annotations"])
    assert merge_patch(old, new) is None
    assert merge_patch(old, by_kind(render_children(live(example()), SETTINGS))["ServiceAccount"]) is None
