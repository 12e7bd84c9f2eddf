"""The RLTrainingJob models: defaults, camelCase, and one clear message per problem."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest

from hybridflow.api import RLTrainingJob, SpecError, load_job, parse_job
from hybridflow.api.schema import cpu_cores
from tests.conftest import EXAMPLES
from tests.helpers import BAD_POD_SETTINGS, BadPodSetting


@pytest.mark.parametrize("name", ["ppo-job.yaml", "grpo-job.yaml", "tiny-ppo.yaml", "tiny-grpo.yaml"])
def test_examples_parse(name: str) -> None:
    job = load_job(EXAMPLES / name)
    assert job.kind == "RLTrainingJob"
    assert job.spec.algorithm.name in ("ppo", "grpo")


def test_camel_case_round_trip(example_doc) -> None:
    doc = example_doc("ppo-job.yaml")
    job = parse_job(doc)
    assert job.spec.algorithm.clip_ratio == 0.2
    out = job.model_dump(by_alias=True, exclude_none=True)
    assert out["spec"]["algorithm"]["clipRatio"] == 0.2
    assert out["spec"]["cluster"]["workerGroups"][0]["gpusPerWorker"] == 8
    assert "status" not in out
    assert parse_job(out) == job


def test_defaults_fill_an_empty_spec() -> None:
    job = parse_job({"apiVersion": "hybridflow.io/v1alpha1", "kind": "RLTrainingJob", "metadata": {"name": "x"}})
    assert job.spec.rollout.engine == "torch"
    assert job.spec.trainer.resume == "auto"
    assert job.spec.scheduling.queue_high_watermark is None  # half a step's sequences (backpressure.high_watermark)


def test_every_problem_is_reported_with_its_path(example_doc) -> None:
    doc = example_doc("tiny-ppo.yaml")
    doc["spec"]["rollout"]["engine"] = "sglang"
    doc["spec"]["data"]["batchSize"] = 0
    doc["spec"]["trainer"]["totalStep"] = 3
    with pytest.raises(SpecError) as info:
        parse_job(doc)
    problems = info.value.problems
    assert len(problems) == 3
    assert any(p.startswith("spec.rollout.engine:") and "'torch' or 'vllm'" in p for p in problems)
    assert any(p.startswith("spec.data.batchSize:") and "greater than or equal to 1" in p for p in problems)
    assert any(p.startswith("spec.trainer.totalStep: unknown field") for p in problems)


def test_cross_field_rules(example_doc) -> None:
    doc = example_doc("tiny-grpo.yaml")
    doc["spec"]["rollout"]["samplesPerPrompt"] = 1
    with pytest.raises(SpecError, match="samplesPerPrompt must be at least 2 for grpo"):
        parse_job(doc)
    doc["spec"]["algorithm"]["gdpo"] = {"rewardKeys": ["score"]}
    for name in ("rloo", "reinforce_plus_plus_baseline", "opo", "grpo_passk", "gdpo", "gpg", "optimal_token_baseline"):
        doc["spec"]["algorithm"]["name"] = name
        with pytest.raises(SpecError, match=f"samplesPerPrompt must be at least 2 for {name} \\(its baseline"):
            parse_job(doc)
    doc["spec"]["algorithm"]["miniBatchSize"] = doc["spec"]["data"]["batchSize"]  # one sample per prompt
    for name in ("reinforce_plus_plus", "remax"):  # no group baseline: one sample is enough
        doc["spec"]["algorithm"]["name"] = name
        assert parse_job(doc).spec.rollout.samples_per_prompt == 1
    doc = example_doc("tiny-ppo.yaml")
    doc["spec"]["algorithm"]["miniBatchSize"] = 10_000
    with pytest.raises(SpecError, match=r"miniBatchSize"):
        parse_job(doc)
    doc = example_doc("tiny-ppo.yaml")
    doc["spec"]["reward"] = {"type": "model"}
    with pytest.raises(SpecError, match=r"reward\.model\.path is required"):
        parse_job(doc)


@pytest.mark.parametrize(("name", "text", "problem"), [
    ("bad.yaml", "spec: [a\n", "malformed YAML: line 2"),
    ("bad.yaml", "- a\n- b\n", "expected a mapping"),
    ("bad.json", '{"spec": [1,\n', "malformed JSON: line 2"),
    ("bad.json", "[1, 2]", "expected a mapping"),
])
def test_malformed_files_and_wrong_documents(tmp_path, name: str, text: str, problem: str) -> None:
    bad = tmp_path / name
    bad.write_text(text)
    with pytest.raises(SpecError, match=problem):
        load_job(bad)


def test_a_missing_file_is_named(tmp_path) -> None:
    with pytest.raises(SpecError, match="file not found"):
        load_job(tmp_path / "missing.yaml")


def test_api_imports_neither_torch_nor_ray() -> None:
    code = "import sys, hybridflow.api, hybridflow.graph; print('torch' in sys.modules, 'ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_status_is_ignored_when_read_from_a_file(example_doc) -> None:
    doc = example_doc("tiny-ppo.yaml")
    doc["status"] = {"phase": "Running"}
    assert isinstance(parse_job(doc), RLTrainingJob)


# -- pod settings of spec.cluster -----------------------------------------------------------------------


def job_with_cluster(cluster: dict) -> dict:
    return {"apiVersion": "hybridflow.io/v1alpha1", "kind": "RLTrainingJob", "metadata": {"name": "pods"},
            "spec": {"cluster": copy.deepcopy(cluster)}}


@pytest.mark.parametrize("bad", BAD_POD_SETTINGS, ids=[b.case for b in BAD_POD_SETTINGS])
def test_pod_settings_that_cannot_work_name_their_field(bad: BadPodSetting) -> None:
    with pytest.raises(SpecError) as info:
        parse_job(job_with_cluster(bad.cluster))
    problems = info.value.problems
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"{bad.field}: ") and bad.says in problems[0], problems


CPU_AMOUNTS = [(2, 2, 2.0), ("2", "2", 2.0), ("1.5", "1.5", 1.5), ("500m", "500m", 0.5), ("0.001", "0.001", 0.001),
               ("1024000m", "1024000m", 1024.0), (1024, 1024, 1024.0), (2.0, 2, 2.0)]


@pytest.mark.parametrize(("written", "kept", "cores"), CPU_AMOUNTS, ids=[repr(c[0]) for c in CPU_AMOUNTS])
def test_cpu_amounts_are_kept_as_written_and_read_as_cores(written: object, kept: object, cores: float) -> None:
    """As Kubernetes spells them, so the pods request exactly that; 2.0 is the integer 2 in JSON."""
    group = {"name": "default", "cpusPerWorker": written}
    cluster = parse_job(job_with_cluster({"headCpus": written, "workerGroups": [group]})).spec.cluster
    for amount in (cluster.head_cpus, cluster.worker_groups[0].cpus_per_worker):
        assert amount == kept and type(amount) is type(kept)
        assert cpu_cores(amount) == pytest.approx(cores)
    assert cluster.to_yaml_dict()["headCpus"] == kept


def test_pod_settings_round_trip_in_kubernetes_spelling() -> None:
    cluster = {
        "volumes": [
            {"name": "models", "persistentVolumeClaim": {"claimName": "models-pvc", "readOnly": True}},
            {"name": "cache", "emptyDir": {}},
            {"name": "certs", "secret": {"secretName": "ca", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
            {"name": "scratch", "hostPath": {"path": "/scratch", "type": "DirectoryOrCreate"}},
            {"name": "weights", "csi": {"driver": "gcsfuse.csi.storage.gke.io", "volumeAttributes": {"bucket": "w"}}},
        ],
        "volumeMounts": [{"name": "models", "mountPath": "/mnt/models", "readOnly": True},
                         {"name": "models", "mountPath": "/mnt/data", "subPath": "data"}],
        "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}},
                {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                {"name": "NCCL_NET_GDR_LEVEL", "value": "PHB"}],
        "envFrom": [{"configMapRef": {"name": "training-env"}, "prefix": "TRAIN_"}],
        "imagePullSecrets": [{"name": "registry-creds"}],
        "serviceAccount": {"annotations": {"iam.gke.io/gcp-service-account": "t@p.iam.gserviceaccount.com"}},
        "podLabels": {"cost-center": "research", "example.com/tier": "gold"},
        "podAnnotations": {"cluster-autoscaler.kubernetes.io/safe-to-evict": "false"},
        "priorityClassName": "training",
    }
    job = parse_job(job_with_cluster(cluster))
    out = job.spec.cluster.to_yaml_dict()
    assert {k: out[k] for k in cluster} == cluster


@pytest.mark.parametrize(("labels", "problem"), [
    ({"-bad": "x"}, "the name must be"),
    ({"Example.com/x": "y"}, "the prefix before '/' must be a DNS subdomain"),
    ({"team": "not ok"}, "the value must be"),
    ({"sub.ray.io/x": "y"}, "belong to the operator and KubeRay"),
])
def test_pod_labels_the_api_server_would_refuse(labels: dict, problem: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_job(job_with_cluster({"podLabels": labels}))
    (line,) = info.value.problems
    assert line.startswith("spec.cluster.podLabels: ") and problem in line


@pytest.mark.parametrize("name", ["ppo-job.yaml", "grpo-job.yaml"])
def test_examples_mount_every_path_they_read_and_write(name: str) -> None:
    spec = load_job(EXAMPLES / name).spec
    mounts = {m.mount_path: m for m in spec.cluster.volume_mounts}
    volumes = {v.name: v for v in spec.cluster.volumes}

    def mount_of(path: str) -> str:
        return next(m for m in mounts if path == m or path.startswith(f"{m}/"))

    read = [spec.model.policy.path, spec.data.train, *filter(None, [spec.model.critic.path])]
    for path in read:
        assert mounts[mount_of(path)].read_only, path
    checkpoints = mounts[mount_of(spec.trainer.checkpoint.path)]
    assert not checkpoints.read_only
    claims = {volumes[m.name].persistent_volume_claim.claim_name for m in mounts.values()}
    assert {"models-pvc", "checkpoints-pvc"} <= claims
    (token,) = [e for e in spec.cluster.env if e.name == "HF_TOKEN"]
    assert token.value_from is not None and token.value_from.secret_key_ref is not None
    assert (token.value_from.secret_key_ref.name, token.value_from.secret_key_ref.key) == ("hf-token", "token")


def test_the_training_options_name_the_field_and_what_it_takes(example_doc) -> None:
    doc = example_doc("tiny-ppo.yaml")
    doc["spec"]["trainer"]["training"] = {"microBatchSize": 0, "shard": "sometimes", "gradientCheckpoint": True,
                                          "microBatchTokens": 0}
    with pytest.raises(SpecError) as info:
        parse_job(doc)
    problems = info.value.problems
    assert len(problems) == 4, problems
    assert any(p.startswith("spec.trainer.training.microBatchTokens:") and "greater than or equal to 1" in p
               for p in problems)
    assert any(p.startswith("spec.trainer.training.microBatchSize:") and "greater than or equal to 1" in p
               for p in problems)
    assert any(p.startswith("spec.trainer.training.shard:") and "boolean" in p for p in problems)
    assert any(p.startswith("spec.trainer.training.gradientCheckpoint: unknown field") for p in problems)
    doc["spec"]["trainer"]["training"] = {"microBatchSize": 4, "gradientCheckpointing": True, "shard": False,
                                          "microBatchTokens": 4096}
    training = parse_job(doc).spec.trainer.training
    assert (training.micro_batch_size, training.micro_batch_tokens, training.gradient_checkpointing,
            training.shard) == (4, 4096, True, False)
    assert parse_job(example_doc("tiny-ppo.yaml")).spec.trainer.training.shard
