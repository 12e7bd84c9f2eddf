"""What may change on children that already exist, as patches. Pure.

A running RayJob takes only a few changes (KubeRay ignores the rest of rayClusterSpec after
creation): suspend, the TTL and deadline, and the replicas of the rollout worker group. They are applied
once per spec generation, so Kueue's suspend and a user's scaling stand; what only the operator sets (the
TTL, the deadline and its labels, which the RayJob watch selects on) is restored whenever it drifts. The
ConfigMap, the Role and the NetworkPolicy are replaced wholesale by their desired content. The ServiceAccount's
annotations (workload identity) are added or changed, never removed: cloud controllers and admins
annotate it too, and the operator keeps no record of which keys were its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridflow.k8s.names import CLUSTER_HASH_ANNOTATION, GENERATION_ANNOTATION, labels

RAYJOB_FIELDS = ("suspend", "ttlSecondsAfterFinished", "activeDeadlineSeconds")
RESTORED_FIELDS = ("ttlSecondsAfterFinished", "activeDeadlineSeconds")  # of RAYJOB_FIELDS, nobody else's
OWN_LABELS = tuple(labels(""))
REPLICA_FIELDS = ("replicas", "minReplicas", "maxReplicas")
MERGED_FIELDS = {"ConfigMap": ("data",), "Role": ("rules",), "RoleBinding": ("subjects",), "NetworkPolicy": ("spec",)}
ANNOTATED_KINDS = ("ServiceAccount",)


def controller_of(obj: Mapping[str, Any]) -> Mapping[str, Any] | None:
    return next((r for r in obj.get("metadata", {}).get("ownerReferences") or [] if r.get("controller")), None)


def ownership_problem(existing: Mapping[str, Any], owner: Mapping[str, Any] | None) -> str | None:
    """Why an existing object with a child's name is not ours to manage; None when it is."""
    if owner is None:
        return None
    ref = controller_of(existing)
    if ref is not None and ref.get("uid") == owner["uid"]:
        return None
    kind, name = existing.get("kind", "object"), existing["metadata"]["name"]
    if ref is None:
        return f"{kind} {name} already exists and is not owned by this job"
    return f"{kind} {name} already exists and is controlled by {ref.get('kind')} {ref.get('name')}"


def stale_owner(existing: Mapping[str, Any], owner: Mapping[str, Any] | None) -> bool:
    """Left over from an earlier job of the same name: garbage collection will remove it shortly."""
    ref = controller_of(existing)
    return bool(owner and ref and ref.get("kind") == owner["kind"] and ref.get("name") == owner["name"]
                and ref.get("uid") != owner["uid"])


def merge_patch(existing: Mapping[str, Any], desired: Mapping[str, Any]) -> dict | None:
    """Merge patch bringing a ConfigMap/Role/RoleBinding to its desired content (a ServiceAccount to its
    desired annotations), or None."""
    fields = MERGED_FIELDS.get(desired["kind"], ())
    patch: dict[str, Any] = {f: desired.get(f) for f in fields if existing.get(f) != desired.get(f)}
    if desired["kind"] in ANNOTATED_KINDS:
        have = existing.get("metadata", {}).get("annotations") or {}
        want = desired["metadata"].get("annotations") or {}
        changed = {k: v for k, v in want.items() if have.get(k) != v}
        if changed:
            patch["metadata"] = {"annotations": changed}
    return patch or None


def rayjob_patch(existing: Mapping[str, Any], desired: Mapping[str, Any], rollout_group: str | None) -> list[dict]:
    """JSON patch (RFC 6902) of the fields a running RayJob accepts; [] when nothing differs."""
    ops: list[dict] = []
    have, want = existing.get("spec") or {}, desired["spec"]
    for key in RAYJOB_FIELDS:
        _set(ops, f"/spec/{key}", have.get(key), want.get(key))
    groups = (have.get("rayClusterSpec") or {}).get("workerGroupSpecs") or []
    wanted = {g["groupName"]: g for g in want["rayClusterSpec"]["workerGroupSpecs"]}
    for i, group in enumerate(groups):
        name = group.get("groupName")
        if name != rollout_group or name not in wanted:
            continue
        base = f"/spec/rayClusterSpec/workerGroupSpecs/{i}"
        changes: list[dict] = []
        for key in REPLICA_FIELDS:
            _set(changes, f"{base}/{key}", group.get(key), wanted[name].get(key))
        if changes:  # guard against the list having changed under us
            ops += [{"op": "test", "path": f"{base}/groupName", "value": name}, *changes]
    generation = desired["metadata"].get("annotations", {}).get(GENERATION_ANNOTATION)
    annotations = existing.get("metadata", {}).get("annotations")
    if generation is not None and (annotations or {}).get(GENERATION_ANNOTATION) != generation:
        if annotations is None:
            ops.append({"op": "add", "path": "/metadata/annotations", "value": {GENERATION_ANNOTATION: generation}})
        else:
            ops.append({"op": "add", "path": f"/metadata/annotations/{_escape(GENERATION_ANNOTATION)}",
                        "value": generation})
    return ops


def label_patch(existing: Mapping[str, Any], desired: Mapping[str, Any]) -> list[dict]:
    """JSON patch putting back the operator's labels (OWN_LABELS) that differ; other labels stay."""
    have = existing.get("metadata", {}).get("labels")
    want = desired["metadata"].get("labels") or {}
    changed = {k: v for k, v in want.items() if k in OWN_LABELS and (have or {}).get(k) != v}
    if not changed:
        return []
    if have is None:
        return [{"op": "add", "path": "/metadata/labels", "value": changed}]
    return [{"op": "add", "path": f"/metadata/labels/{_escape(k)}", "value": v} for k, v in changed.items()]


def restore_patch(existing: Mapping[str, Any], desired: Mapping[str, Any]) -> list[dict]:
    """JSON patch restoring what only the operator sets on a RayJob of the current generation: RESTORED_FIELDS
    and its labels; [] when nothing drifted."""
    ops: list[dict] = []
    have, want = existing.get("spec") or {}, desired["spec"]
    for key in RESTORED_FIELDS:
        _set(ops, f"/spec/{key}", have.get(key), want.get(key))
    return ops + label_patch(existing, desired)


def owned_state(rayjob: Mapping[str, Any]) -> tuple[Any, ...]:
    """What restore_patch restores, as the RayJob has it: a change by someone else shows as a new value."""
    spec = rayjob.get("spec") or {}
    have = rayjob.get("metadata", {}).get("labels") or {}
    return (*(spec.get(key) for key in RESTORED_FIELDS), *(have.get(key) for key in OWN_LABELS))


def layout_changed(existing: Mapping[str, Any], desired: Mapping[str, Any]) -> bool:
    """The desired cluster differs beyond what a running RayJob accepts (it then keeps its old layout)."""
    def digest(obj: Mapping[str, Any]) -> str | None:
        return (obj.get("metadata", {}).get("annotations") or {}).get(CLUSTER_HASH_ANNOTATION)

    return digest(existing) is not None and digest(existing) != digest(desired)


def _set(ops: list[dict], path: str, have: Any, want: Any) -> None:
    if want is None and have is not None:
        ops.append({"op": "remove", "path": path})
    elif want is not None and want != have:
        ops.append({"op": "add", "path": path, "value": want})


def _escape(key: str) -> str:
    """JSON pointer escaping (RFC 6901)."""
    return key.replace("~", "~0").replace("/", "~1")
