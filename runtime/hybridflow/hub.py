"""Hugging Face Hub names of models and datasets: parsing (pure) and resolution into the local Hub cache.

    model:   Org/Name | hf://Org/Name[@REVISION]
    dataset: hf://datasets/Org/Name[@REVISION][/CONFIG][?split=SPLIT]      (split: train when absent)

A bare `Org/Name` names the Hub unless a local directory of that name exists (as in `from_pretrained`);
`hf://` always names the Hub. REVISION is a branch, a tag or a commit hash.

The driver fetches every name once before any worker starts (preflight) into the Hub cache
($HF_HOME/hub, or $HF_HUB_CACHE), then pins it to the commit it found (`pin_sources`): the controller and
the workers, on whichever pod, open that exact snapshot from the cache without asking the Hub. A pod that
does not share the cache (HF_HOME on a shared volume) fetches the pinned commit itself, once per pod.
HF_HUB_OFFLINE=1 never leaves the cache; HF_TOKEN (from a Secret, through spec.cluster.env) opens
private and gated repositories. Requests to the Hub time out after $HF_HUB_ETAG_TIMEOUT seconds (10).

Everything here reads the environment when called, not when imported, and imports huggingface_hub only
when a Hub name is resolved: the API models use the parsing below without it.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from hybridflow.api.spec import RLTrainingJobSpec

log = logging.getLogger(__name__)

RepoType = Literal["model", "dataset"]
SCHEME = "hf://"
DATASETS = "hf://datasets/"
DEFAULT_SPLIT = "train"
DEFAULT_TIMEOUT_S = 10.0

# The patterns are valid both in Python and in RE2 (the API server's CEL `matches`): no backslashes, no
# look-around. A name part starts and ends with a letter, digit or underscore, as the Hub's repo ids do.
_PART = "[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?"
_REVISION = "[A-Za-z0-9_][A-Za-z0-9_.-]*"
_CONFIG = "[A-Za-z0-9_][A-Za-z0-9_.+-]*"
_SPLIT = "[A-Za-z0-9_][A-Za-z0-9_.-]*"
MODEL_PATTERN = f"^hf://(?P<repo>({_PART}/)?{_PART})(@(?P<revision>{_REVISION}))?$"
BARE_MODEL_PATTERN = f"^(?P<repo>{_PART}/{_PART})$"
DATASET_PATTERN = (f"^hf://datasets/(?P<repo>{_PART}/{_PART})(@(?P<revision>{_REVISION}))?"
                   f"(/(?P<config>{_CONFIG}))?([?]split=(?P<split>{_SPLIT}))?$")

MODEL_SYNTAX = "a Hub model is Org/Name or hf://Org/Name[@revision] (a branch, tag or commit hash)"
DATASET_SYNTAX = (f"a Hub dataset is hf://datasets/Org/Name[@revision][/config][?split=name] "
                  f"(split defaults to {DEFAULT_SPLIT})")

_COMMIT = re.compile("^[0-9a-f]{40}$")


class HubRefError(ValueError):
    """A string that starts with hf:// but is not a Hub name of the kind the field takes."""


class HubError(ValueError):
    """A Hub name that cannot be resolved here; the message names the spec field and says why."""


@dataclass(frozen=True)
class HubRef:
    """One model or dataset on the Hub, at a revision (None: the default branch)."""

    repo_id: str
    repo_type: RepoType = "model"
    revision: str | None = None
    config: str | None = None
    split: str = DEFAULT_SPLIT
    explicit: bool = True
    """Written with hf://; a bare Org/Name is shadowed by a local directory of that name."""

    @property
    def uri(self) -> str:
        """The canonical hf:// form, which parses back to this reference."""
        at = f"@{self.revision}" if self.revision else ""
        if self.repo_type == "model":
            return f"{SCHEME}{self.repo_id}{at}"
        config = f"/{self.config}" if self.config else ""
        return f"{DATASETS}{self.repo_id}{at}{config}?split={self.split}"

    @property
    def is_commit(self) -> bool:
        return self.revision is not None and _COMMIT.match(self.revision) is not None

    def at(self, commit: str) -> HubRef:
        return replace(self, revision=commit, explicit=True)

    def describe(self) -> str:
        return f"Hub {self.repo_type} {self.repo_id!r} (revision {self.revision or 'main'})"


def parse_hub_ref(value: str, kind: RepoType = "model") -> HubRef | None:
    """The Hub reference `value` spells for a field taking a `kind`, or None when it names no Hub repo.

    Pure. Raises HubRefError for an hf:// string that is malformed or of the other kind.
    """
    if kind == "dataset":
        if not value.startswith(SCHEME):
            return None
        m = re.fullmatch(DATASET_PATTERN, value)
        if m is None:
            raise HubRefError(f"{value!r} is not a Hub dataset name: {DATASET_SYNTAX}")
        return HubRef(m["repo"], "dataset", m["revision"], m["config"], m["split"] or DEFAULT_SPLIT)
    if value.startswith(DATASETS):
        raise HubRefError(f"{value!r} names a Hub dataset, not a model: {MODEL_SYNTAX}")
    if value.startswith(SCHEME):
        m = re.fullmatch(MODEL_PATTERN, value)
        if m is None:
            raise HubRefError(f"{value!r} is not a Hub model name: {MODEL_SYNTAX}")
        return HubRef(m["repo"], "model", m["revision"])
    m = re.fullmatch(BARE_MODEL_PATTERN, value)
    return HubRef(m["repo"], "model", explicit=False) if m else None


def ref_problem(value: str, kind: RepoType) -> str | None:
    """Why `value` cannot be the Hub name it looks like (for the spec validators), else None."""
    try:
        parse_hub_ref(value, kind)
    except HubRefError as e:
        return str(e)
    return None


def cel_rule(kind: RepoType) -> tuple[str, str]:
    """(CEL rule, message) that makes the API server refuse what `ref_problem` refuses."""
    if kind == "dataset":
        return f"!self.startsWith('{SCHEME}') || self.matches('{DATASET_PATTERN}')", DATASET_SYNTAX
    return (f"!self.startsWith('{SCHEME}') || (!self.startsWith('{DATASETS}') && self.matches('{MODEL_PATTERN}'))",
            MODEL_SYNTAX)


# -- the environment, read when called -------------------------------------------------------------


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE), as huggingface_hub reads it: never leave the cache."""
    return _truthy("HF_HUB_OFFLINE") or _truthy("TRANSFORMERS_OFFLINE")


def _env_path(*names: str) -> Path | None:
    for name in names:
        if os.environ.get(name):
            return Path(os.path.expandvars(os.environ[name])).expanduser()
    return None


def hf_home() -> Path:
    xdg = _env_path("XDG_CACHE_HOME") or Path.home() / ".cache"
    return _env_path("HF_HOME") or xdg / "huggingface"


def hub_cache() -> Path:
    """Where snapshots live: $HF_HUB_CACHE, else $HF_HOME/hub."""
    return _env_path("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE") or hf_home() / "hub"


def datasets_cache() -> Path:
    """Where the datasets library keeps its Arrow files: $HF_DATASETS_CACHE, else $HF_HOME/datasets."""
    return _env_path("HF_DATASETS_CACHE") or hf_home() / "datasets"


def _endpoint() -> str | None:
    """$HF_ENDPOINT (a mirror or a Hub of one's own); None: huggingface.co."""
    return os.environ.get("HF_ENDPOINT") or None


def hub_timeout() -> float:
    """Seconds a request to the Hub may take before the Hub counts as unreachable."""
    try:
        return float(os.environ.get("HF_HUB_ETAG_TIMEOUT") or DEFAULT_TIMEOUT_S)
    except ValueError:
        return DEFAULT_TIMEOUT_S


# -- resolution ------------------------------------------------------------------------------------


def cached_snapshot(ref: HubRef, field: str) -> Path | None:
    """The snapshot directory of `ref` in the Hub cache, without any request; None when it is not there."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(ref.repo_id, repo_type=ref.repo_type, revision=ref.revision,
                                      cache_dir=hub_cache(), local_files_only=True))
    except LocalEntryNotFoundError:  # also a snapshot whose cached file list says it is incomplete
        return None
    except HFValidationError as e:
        raise HubError(f"{field}: {ref.repo_id!r} is not a valid Hub repo id: {_first_line(e)}") from None


def ask_hub(ref: HubRef) -> BaseException | None:
    """None when the Hub knows `ref` (the token in HF_TOKEN included); else why not, within hub_timeout()."""
    from huggingface_hub import HfApi

    try:
        HfApi(endpoint=_endpoint()).repo_info(
            ref.repo_id, repo_type=ref.repo_type, revision=ref.revision, timeout=hub_timeout())
    except Exception as e:  # network errors differ between huggingface_hub versions; explain() sorts them
        return e
    return None


def explain(ref: HubRef, field: str, error: BaseException | None) -> str:
    """One line naming the field, the name and what to do: `error` is the Hub's answer (None: offline)."""
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    head = f"{field}: {ref.describe()}"
    if not ref.explicit:
        head = f"{field}: {ref.repo_id!r} is not a local directory, and as a {ref.describe()} it"
    if error is None:
        return f"{head} is not in the Hub cache {hub_cache()} and HF_HUB_OFFLINE forbids fetching it"
    if isinstance(error, GatedRepoError):
        return f"{head} is gated: accept its conditions on the Hub and give the job an HF_TOKEN that may read it"
    if isinstance(error, RepositoryNotFoundError):
        return f"{head} does not exist on the Hub (a private one needs HF_TOKEN)"
    if isinstance(error, RevisionNotFoundError):
        return f"{head}: no such revision on the Hub"
    if isinstance(error, HfHubHTTPError):
        return f"{head}: the Hub refused it ({_first_line(error)})"
    return (f"{head} is not in the Hub cache {hub_cache()} and the Hub could not be reached within "
            f"{hub_timeout():g}s ({type(error).__name__}: {_first_line(error)})")


def snapshot(ref: HubRef, field: str) -> Path:
    """The local snapshot directory of `ref`, fetched into the Hub cache when it is missing or stale.

    A commit hash is immutable, so the cache answers alone when it has it; a branch or tag asks the Hub
    for its current commit unless offline. Offline, or with the Hub unreachable, the cache answers.
    """
    offline = hub_offline()
    if offline or ref.is_commit:
        found = cached_snapshot(ref, field)
        if found is not None:
            return found
        if offline:
            raise HubError(explain(ref, field, None))
    problem = ask_hub(ref)
    if problem is None:
        return _download(ref, field)
    found = cached_snapshot(ref, field)
    if found is not None:
        log.warning("%s: the Hub did not answer for %s (%s); using the cached snapshot %s",
                    field, ref.uri, type(problem).__name__, found.name)
        return found
    raise HubError(explain(ref, field, problem))


def _download(ref: HubRef, field: str) -> Path:
    from huggingface_hub import snapshot_download

    log.info("%s: fetching %s into %s", field, ref.uri, hub_cache())
    try:
        return Path(snapshot_download(ref.repo_id, repo_type=ref.repo_type, revision=ref.revision,
                                      cache_dir=hub_cache(), etag_timeout=hub_timeout(), endpoint=_endpoint()))
    except Exception as e:  # a broken connection mid-download, a full disk, a read-only cache
        raise HubError(f"{field}: fetching {ref.uri} into {hub_cache()} failed: "
                       f"{type(e).__name__}: {_first_line(e)}") from None


def availability_problem(ref: HubRef, field: str) -> str | None:
    """What `hybridflow validate` can say without downloading: in the cache, or known to the Hub."""
    if cached_snapshot(ref, field) is not None:
        return None
    if hub_offline():
        return explain(ref, field, None)
    problem = ask_hub(ref)
    return None if problem is None else explain(ref, field, problem)


def model_ref(path: str) -> HubRef | None:
    """The Hub model a model path names: hf:// always, a bare Org/Name unless it is a local directory."""
    ref = parse_hub_ref(path, "model")
    if ref is None or (not ref.explicit and Path(path).is_dir()):
        return None
    return ref


def resolve_model_path(path: str, field: str) -> str:
    """The local directory to load a model path from: builtin:tiny's, a Hub snapshot, or the path itself."""
    from hybridflow.data.tiny import TINY_MODEL, ensure_tiny_model

    if path == TINY_MODEL:
        return str(ensure_tiny_model())
    try:
        ref = model_ref(path)
    except HubRefError as e:
        raise HubError(f"{field}: {e}") from None
    return path if ref is None else str(snapshot(ref, field))


# -- the Hub names of a job ------------------------------------------------------------------------


def hub_sources(spec: RLTrainingJobSpec) -> list[tuple[str, HubRef]]:
    """(spec field, reference) of every model and dataset of the job that comes from the Hub."""
    out: list[tuple[str, HubRef]] = []
    for field, path in spec.model_paths():
        ref = model_ref(path)
        if ref is not None:
            out.append((field, ref))
    for field, source in spec.data_sources():
        ref = parse_hub_ref(source, "dataset")
        if ref is not None:
            out.append((field, ref))
    return out


def hub_problems(spec: RLTrainingJobSpec) -> list[str]:
    """`hybridflow validate`: every Hub name of the job neither in the cache nor known to the Hub."""
    problems = []
    for field, ref in hub_sources(spec):
        try:
            problem = availability_problem(ref, field)
        except HubError as e:
            problem = str(e)
        if problem:
            problems.append(problem)
    return problems


def pin_sources(spec: RLTrainingJobSpec) -> RLTrainingJobSpec:
    """A copy of the spec with each Hub name fetched into the cache written as hf://...@<commit>.

    The driver calls it after preflight has fetched them: the controller and every worker then open the
    same snapshot, even if the branch moves on the Hub while the job runs.
    """
    pinned = spec.model_copy(deep=True)
    for field, ref in hub_sources(spec):
        found = cached_snapshot(ref, field)
        if found is not None:
            _assign(pinned, field, ref.at(found.name).uri)
    return pinned


def _assign(spec: Any, field: str, value: str) -> None:
    """Set `spec.a.b.c` (a field path as messages spell it, without the leading `spec.`)."""
    *parents, leaf = field.removeprefix("spec.").split(".")
    target = spec
    for name in parents:
        target = getattr(target, name)
    setattr(target, leaf, value)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
