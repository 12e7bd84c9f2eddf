"""What a platform engineer adds to the job's Ray pods: volumes, env, pull secrets, pod metadata.

Typed subsets of the Kubernetes core/v1 objects (Volume, VolumeMount, EnvVar, EnvFromSource), with
the fields that matter for a training job and the same camelCase names, so a snippet from a pod spec
pastes in unchanged. Typed rather than a free-form pod-template patch: the CRD's schema must be
structural, and typed fields get schema validation, CEL rules and `hybridflow validate` messages that
name the field (a patch would only fail later, when KubeRay creates the pods).

The names, mount paths and variables the operator sets itself are reserved here (the API imports
nothing from hybridflow.k8s; tests/test_render.py checks that every one the operator renders is).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Annotated, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

from hybridflow.api.base import ApiModel
from hybridflow.api.schema import Quantity, cel, rules

# Bounds on lists and maps, so the API server's cost estimate of the CEL rules stays within its budget.
MAX_VOLUMES = 32
MAX_VOLUME_MOUNTS = 32
MAX_ENV = 64
MAX_ENV_FROM = 16
MAX_IMAGE_PULL_SECRETS = 16
MAX_KEY_ITEMS = 64
MAX_POD_METADATA = 64
MAX_PATH = 1024

# What the operator puts in every Ray pod itself (hybridflow.k8s.pods, hybridflow.k8s.contract).
OPERATOR_VOLUME_PREFIX = "hybridflow-"
OPERATOR_VOLUMES = ("hybridflow-config", "dshm")
CONFIG_DIR = "/etc/hybridflow"
SHM_DIR = "/dev/shm"
OPERATOR_ENV_PREFIX = "HYBRIDFLOW_"
OPERATOR_ENV = (
    "NVIDIA_VISIBLE_DEVICES",
    "NCCL_CUMEM_ENABLE",
    "NCCL_SOCKET_IFNAME",
    "NCCL_IB_HCA",
    "NCCL_IB_DISABLE",
    "NCCL_DEBUG",
)
# Label and annotation domains of the operator and of KubeRay, which label the pods it creates.
OPERATOR_LABEL_DOMAINS = ("hybridflow.io", "ray.io")

DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
ObjectName = Annotated[str, Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)]
VolumeName = Annotated[str, Field(min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")]
EnvName = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")]
FileMode = Annotated[int, Field(ge=0, le=0o777)]
PathText = Annotated[str, Field(min_length=1, max_length=MAX_PATH)]

_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_DNS_SUBDOMAIN = re.compile(DNS_SUBDOMAIN)
_ENV_MESSAGE = (
    f"env names {OPERATOR_ENV_PREFIX}* and {', '.join(OPERATOR_ENV)} are set by the operator"
    " (the NCCL ones through cluster.nccl)"
)
_VOLUME_MESSAGE = (
    f"volume names {' and '.join(OPERATOR_VOLUMES)} (and {OPERATOR_VOLUME_PREFIX}*) are the operator's own"
)
_MOUNT_MESSAGE = f"mountPath {CONFIG_DIR} (and below it) and {SHM_DIR} are the operator's own mounts"
_ABSOLUTE_MESSAGE = "mountPath must be an absolute path such as /mnt/models, without '.', '..' or a trailing '/'"


def _quoted(names: Iterable[str]) -> str:
    """A CEL list literal of strings."""
    return "[" + ", ".join(f"'{n}'" for n in names) + "]"


def label_key_problem(key: str) -> str | None:
    """Why `key` is no valid label or annotation key (an optional DNS-subdomain prefix, '/', a name)."""
    prefix, _, name = key.rpartition("/")
    if prefix and (len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix)):
        return f"key {key!r}: the prefix before '/' must be a DNS subdomain (lowercase, digits, '-', '.')"
    if len(name) > 63 or not _LABEL_NAME.match(name):
        return f"key {key!r}: the name must be 1-63 letters, digits, '-', '_' or '.', alphanumeric at both ends"
    return None


def label_value_problem(key: str, value: str) -> str | None:
    if value and (len(value) > 63 or not _LABEL_NAME.match(value)):
        return f"label {key!r}: the value must be at most 63 letters, digits, '-', '_' or '.', alphanumeric at ends"
    return None


def key_domain(key: str) -> str:
    """The prefix of a label or annotation key ('' for none): `team.example.com/x` -> team.example.com."""
    return key.rpartition("/")[0]


def in_domains(key: str, domains: Iterable[str]) -> bool:
    """Whether the key's prefix is one of `domains` or a subdomain of one."""
    prefix = key_domain(key)
    return any(prefix == d or prefix.endswith(f".{d}") for d in domains)


def _set_fields(model: ApiModel, fields: Iterable[str]) -> list[str]:
    """The camelCase names of those of `fields` that are given."""
    return [to_camel(f) for f in fields if getattr(model, f) is not None]


def _exactly_one(model: ApiModel, fields: tuple[str, ...], what: str) -> None:
    given = _set_fields(model, fields)
    if len(given) != 1:
        names = ", ".join(to_camel(f) for f in fields)
        got = f"got {', '.join(given)}" if given else "got none"
        raise ValueError(f"{what} needs exactly one of {names}; {got}")


def _one_of_rule(fields: tuple[str, ...], what: str) -> dict[str, str]:
    """CEL: exactly one of `fields` is set."""
    count = " + ".join(f"(has(self.{to_camel(f)}) ? 1 : 0)" for f in fields)
    return cel(f"{count} == 1", f"{what} needs exactly one of {', '.join(to_camel(f) for f in fields)}")


# -- volumes -----------------------------------------------------------------------------------------


class KeyToPath(ApiModel):
    key: str = Field(min_length=1, max_length=253)
    path: str = Field(min_length=1, max_length=MAX_PATH)
    """Relative file path inside the volume."""
    mode: FileMode | None = None


class PersistentVolumeClaimSource(ApiModel):
    claim_name: ObjectName
    """A PersistentVolumeClaim in the job's namespace."""
    read_only: bool | None = None


class ConfigMapVolumeSource(ApiModel):
    name: ObjectName
    items: list[KeyToPath] | None = Field(None, max_length=MAX_KEY_ITEMS)
    default_mode: FileMode | None = None
    optional: bool | None = None


class SecretVolumeSource(ApiModel):
    secret_name: ObjectName
    items: list[KeyToPath] | None = Field(None, max_length=MAX_KEY_ITEMS)
    default_mode: FileMode | None = None
    optional: bool | None = None


class EmptyDirVolumeSource(ApiModel):
    medium: Literal["", "Memory"] | None = None
    size_limit: Quantity | None = None


class HostPathVolumeSource(ApiModel):
    model_config = ApiModel.model_config | ConfigDict(
        json_schema_extra=rules(cel("self.path.startsWith('/')", "hostPath.path must be an absolute path", ".path"))
    )

    path: PathText
    type: (
        Literal["", "DirectoryOrCreate", "Directory", "FileOrCreate", "File", "Socket", "CharDevice", "BlockDevice"]
        | None
    ) = None

    @field_validator("path")
    @classmethod
    def _absolute(cls, path: str) -> str:
        if not path.startswith("/"):
            raise ValueError("hostPath.path must be an absolute path")
        return path


class LocalObjectReference(ApiModel):
    name: ObjectName


class CSIVolumeSource(ApiModel):
    driver: str = Field(min_length=1, max_length=63)
    read_only: bool | None = None
    fs_type: str | None = None
    volume_attributes: dict[str, str] | None = Field(None, max_length=MAX_POD_METADATA)
    node_publish_secret_ref: LocalObjectReference | None = None


_VOLUME_SOURCES = ("persistent_volume_claim", "config_map", "secret", "empty_dir", "host_path", "csi")


class Volume(ApiModel):
    """A pod volume: a PVC (models, data, checkpoints), a ConfigMap or Secret, an emptyDir, a hostPath or CSI."""

    model_config = ApiModel.model_config | ConfigDict(
        json_schema_extra=rules(
            _one_of_rule(_VOLUME_SOURCES, "a volume"),
            cel(
                f"!(self.name in {_quoted(OPERATOR_VOLUMES)}) && !self.name.startsWith('{OPERATOR_VOLUME_PREFIX}')",
                _VOLUME_MESSAGE,
                ".name",
            ),
        )
    )

    name: VolumeName
    persistent_volume_claim: PersistentVolumeClaimSource | None = None
    config_map: ConfigMapVolumeSource | None = None
    secret: SecretVolumeSource | None = None
    empty_dir: EmptyDirVolumeSource | None = None
    host_path: HostPathVolumeSource | None = None
    csi: CSIVolumeSource | None = None

    @field_validator("name")
    @classmethod
    def _not_the_operators(cls, name: str) -> str:
        if name in OPERATOR_VOLUMES or name.startswith(OPERATOR_VOLUME_PREFIX):
            raise ValueError(f"{_VOLUME_MESSAGE}; rename volume {name!r}")
        return name

    @model_validator(mode="after")
    def _one_source(self) -> Volume:
        _exactly_one(self, _VOLUME_SOURCES, f"volume {self.name!r}")
        return self


def mount_path_problem(path: str) -> str | None:
    """Why a mountPath cannot be used: not absolute and normal, or where the operator mounts its own."""
    parts = path.split("/")
    if not path.startswith("/") or len(parts) < 2 or any(p in ("", ".", "..") for p in parts[1:]):
        return f"{_ABSOLUTE_MESSAGE} (got {path!r})"
    if path in (CONFIG_DIR, SHM_DIR) or path.startswith(f"{CONFIG_DIR}/"):
        return f"{_MOUNT_MESSAGE} (got {path!r}); cluster.shmSize sizes /dev/shm"
    return None


class VolumeMount(ApiModel):
    """Where a volume of cluster.volumes appears in the Ray container, in the head and every worker."""

    model_config = ApiModel.model_config | ConfigDict(
        json_schema_extra=rules(
            cel(
                "self.mountPath.matches('^(/[^/]+)+$') && !self.mountPath.matches('(^|/)[.][.]?(/|$)')",
                _ABSOLUTE_MESSAGE,
                ".mountPath",
            ),
            cel(
                f"self.mountPath != '{CONFIG_DIR}' && !self.mountPath.startsWith('{CONFIG_DIR}/')"
                f" && self.mountPath != '{SHM_DIR}'",
                _MOUNT_MESSAGE,
                ".mountPath",
            ),
            cel(
                "!has(self.subPath) || (!self.subPath.startsWith('/') && !self.subPath.matches('(^|/)[.][.](/|$)'))",
                "subPath must be a relative path without '..'",
                ".subPath",
            ),
        )
    )

    name: VolumeName
    """A volume of cluster.volumes."""
    mount_path: PathText
    read_only: bool | None = None
    sub_path: PathText | None = None
    """A path inside the volume to mount instead of its root."""

    @field_validator("mount_path")
    @classmethod
    def _usable_path(cls, path: str) -> str:
        problem = mount_path_problem(path)
        if problem:
            raise ValueError(problem)
        return path

    @field_validator("sub_path")
    @classmethod
    def _relative(cls, path: str | None) -> str | None:
        if path is not None and (path.startswith("/") or ".." in path.split("/")):
            raise ValueError(f"subPath must be a relative path without '..' (got {path!r})")
        return path


# -- environment -------------------------------------------------------------------------------------


class KeySelector(ApiModel):
    """A key of a Secret or ConfigMap in the job's namespace."""

    name: ObjectName
    key: str = Field(min_length=1, max_length=253)
    optional: bool | None = None


class ObjectFieldSelector(ApiModel):
    field_path: str = Field(
        pattern=r"^(metadata\.(name|namespace|uid|labels\['[^']+'\]|annotations\['[^']+'\])"
        r"|spec\.(nodeName|serviceAccountName)|status\.(hostIP|hostIPs|podIP|podIPs))$",
        max_length=MAX_PATH,
    )
    """The downward API: metadata.name, metadata.labels['x'], spec.nodeName, status.podIP, ..."""
    api_version: str | None = None


_ENV_SOURCES = ("secret_key_ref", "config_map_key_ref", "field_ref")


class EnvVarSource(ApiModel):
    model_config = ApiModel.model_config | ConfigDict(json_schema_extra=rules(_one_of_rule(_ENV_SOURCES, "valueFrom")))

    secret_key_ref: KeySelector | None = None
    config_map_key_ref: KeySelector | None = None
    field_ref: ObjectFieldSelector | None = None

    @model_validator(mode="after")
    def _one_source(self) -> EnvVarSource:
        _exactly_one(self, _ENV_SOURCES, "valueFrom")
        return self


def env_name_problem(name: str) -> str | None:
    if name.startswith(OPERATOR_ENV_PREFIX) or name in OPERATOR_ENV:
        return f"{_ENV_MESSAGE} (got {name!r})"
    return None


class EnvVar(ApiModel):
    """A variable of the Ray container: a value, or valueFrom a Secret key (HF_TOKEN), a ConfigMap key or the pod."""

    model_config = ApiModel.model_config | ConfigDict(
        json_schema_extra=rules(
            cel(
                f"!self.name.startsWith('{OPERATOR_ENV_PREFIX}') && !(self.name in {_quoted(OPERATOR_ENV)})",
                _ENV_MESSAGE,
                ".name",
            ),
            cel("!has(self.value) || !has(self.valueFrom)", "an env var takes value or valueFrom, not both"),
        )
    )

    name: EnvName
    value: str | None = None
    value_from: EnvVarSource | None = None

    @field_validator("name")
    @classmethod
    def _not_the_operators(cls, name: str) -> str:
        problem = env_name_problem(name)
        if problem:
            raise ValueError(problem)
        return name

    @model_validator(mode="after")
    def _value_or_value_from(self) -> EnvVar:
        if self.value is not None and self.value_from is not None:
            raise ValueError(f"env {self.name!r} takes value or valueFrom, not both")
        return self


class ObjectRef(ApiModel):
    name: ObjectName
    optional: bool | None = None


_ENV_FROM_SOURCES = ("secret_ref", "config_map_ref")


class EnvFromSource(ApiModel):
    """Every key of a Secret or ConfigMap as a variable; cluster.env and the operator's own win on a clash."""

    model_config = ApiModel.model_config | ConfigDict(
        json_schema_extra=rules(_one_of_rule(_ENV_FROM_SOURCES, "an envFrom entry"))
    )

    prefix: str | None = Field(None, max_length=256)
    secret_ref: ObjectRef | None = None
    config_map_ref: ObjectRef | None = None

    @model_validator(mode="after")
    def _one_source(self) -> EnvFromSource:
        _exactly_one(self, _ENV_FROM_SOURCES, "an envFrom entry")
        return self


class ServiceAccountSettings(ApiModel):
    """The job's runtime ServiceAccount, which every Ray pod runs as."""

    annotations: dict[str, str] = Field(default_factory=dict, max_length=MAX_POD_METADATA)
    """Cloud workload identity: iam.gke.io/gcp-service-account, eks.amazonaws.com/role-arn,
    azure.workload.identity/client-id."""

    @field_validator("annotations")
    @classmethod
    def _valid_keys(cls, annotations: dict[str, str]) -> dict[str, str]:
        problems = metadata_problems(annotations, labels=False, reserved=())
        if problems:
            raise ValueError("; ".join(problems))
        return annotations


def metadata_problems(items: Mapping[str, str], *, labels: bool, reserved: Iterable[str]) -> list[str]:
    """Keys (and, for labels, values) the API server would refuse, and keys in `reserved` domains."""
    domains = tuple(reserved)
    problems = []
    for key, value in items.items():
        problem = label_key_problem(key) or (label_value_problem(key, value) if labels else None)
        if problem is None and in_domains(key, domains):
            problem = f"key {key!r}: the domains {', '.join(domains)} belong to the operator and KubeRay"
        if problem:
            problems.append(problem)
    return problems


def reserved_key_rule(domains: Iterable[str]) -> dict[str, str]:
    """CEL on a map: no key in the given domains (exact prefixes; the models also refuse subdomains)."""
    domains = tuple(domains)
    checks = " && ".join(f"!k.startsWith('{d}/')" for d in domains)
    return cel(f"self.all(k, {checks})", f"keys in the domains {', '.join(domains)} belong to the operator and KubeRay")
