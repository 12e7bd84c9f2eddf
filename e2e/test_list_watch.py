"""The operator's informer against a real kube-apiserver: list, watch, resume, and list again.

The minimal control plane runs no scheduler, so pods stay unbound until a test binds them itself.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from kubernetes import client, config

from e2e.harness.controlplane import ControlPlane
from hybridflow.k8s import names
from hybridflow_operator.machinery import informer as informer_module
from hybridflow_operator.machinery.client import Kube
from hybridflow_operator.machinery.informer import Informer, Source, collection_path

pytestmark = pytest.mark.controlplane
WAIT_S = 30.0


def pod(name: str, *, labelled: bool = True, node: str | None = None) -> dict:
    labels = {names.JOB_LABEL: "job-a"} if labelled else {}
    spec: dict[str, Any] = {"containers": [{"name": "c", "image": "registry.invalid/none"}]}
    if node:
        spec["nodeName"] = node
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels}, "spec": spec}


class Recorder:
    """What the informer delivered, in order: (type, name)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    def __call__(self, obj: Any, kind: str) -> None:
        assert obj.get("kind") == "Pod", obj.get("kind")
        self.seen.append((kind, obj["metadata"]["name"]))

    async def until(self, predicate: Callable[[], bool], what: str) -> None:
        deadline = asyncio.get_running_loop().time() + WAIT_S
        while not predicate():
            assert asyncio.get_running_loop().time() < deadline, f"waited {WAIT_S:.0f}s for {what}; saw {self.seen}"
            await asyncio.sleep(0.05)


def kube_for(cp: ControlPlane) -> Kube:
    configuration = client.Configuration()
    config.load_kube_config(config_file=str(cp.kubeconfig), client_configuration=configuration)
    return Kube(configuration)


async def running(informer: Informer, body: Callable[[], Awaitable[None]]) -> None:
    task = asyncio.get_running_loop().create_task(informer.run())
    try:
        await asyncio.wait_for(informer.synced.wait(), WAIT_S)
        await body()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def create(cp: ControlPlane, namespace: str, *objs: dict) -> None:
    body = json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objs)})
    cp.kubectl("create", "-n", namespace, "-f", "-", input=body)


def bind(cp: ControlPlane, namespace: str, name: str, node: str) -> None:
    binding = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": name},
               "target": {"apiVersion": "v1", "kind": "Node", "name": node}}
    cp.kubectl("create", "-n", namespace, "--raw", f"/api/v1/namespaces/{namespace}/pods/{name}/binding",
               "-f", "-", input=json.dumps(binding))


def test_unbound_labelled_pods_are_listed_watched_and_leave_when_bound(
    control_plane: ControlPlane, namespace: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(informer_module, "WATCH_TIMEOUT_S", 1)  # the server ends every watch within 1-2 s
    create(control_plane, namespace, pod("early"), pod("foreign", labelled=False), pod("placed", node="node-1"))
    seen = Recorder()
    source = Source(collection_path("v1", "pods", namespace), "Pod", names.JOB_LABEL, "spec.nodeName=")
    kube = kube_for(control_plane)
    informer = Informer(kube, source, seen, name="test pods")

    async def scenario() -> None:
        assert seen.seen == [("ADDED", "early")]  # the list: not someone else's pod, not a bound one
        create(control_plane, namespace, pod("late"))
        await seen.until(lambda: ("ADDED", "late") in seen.seen, "the new pod")
        await asyncio.sleep(3)  # at least one watch ends and resumes from where it was
        control_plane.kubectl("label", "pod", "late", "-n", namespace, "extra=1")
        await seen.until(lambda: ("MODIFIED", "late") in seen.seen, "the relabelled pod")
        bind(control_plane, namespace, "early", "node-1")
        await seen.until(lambda: ("DELETED", "early") in seen.seen, "the bound pod leaving the selection")

    async def main() -> None:
        try:
            await running(informer, scenario)
        finally:
            await kube.close()

    asyncio.run(main())
    assert seen.seen.count(("ADDED", "late")) == 1  # resuming a watch replays nothing
    assert all(name in ("early", "late") for _, name in seen.seen)
    assert set(informer.known) == {(namespace, "late")}


def test_a_new_list_delivers_what_changed_while_nobody_watched(control_plane: ControlPlane, namespace: str) -> None:
    create(control_plane, namespace, pod("stays"), pod("goes"))
    seen = Recorder()
    source = Source(collection_path("v1", "pods", namespace), "Pod", names.JOB_LABEL, "spec.nodeName=")
    kube = kube_for(control_plane)
    informer = Informer(kube, source, seen, name="test pods")

    async def first() -> None:
        assert sorted(seen.seen) == [("ADDED", "goes"), ("ADDED", "stays")]

    async def second() -> None:
        assert ("DELETED", "goes") in seen.seen and ("ADDED", "new") in seen.seen

    async def main() -> None:
        try:
            await running(informer, first)
            control_plane.kubectl("delete", "pod", "goes", "-n", namespace, "--wait=false")
            create(control_plane, namespace, pod("new"))
            seen.seen.clear()
            informer.synced.clear()
            await running(informer, second)  # starts with a list, as after a 410 Gone
        finally:
            await kube.close()

    asyncio.run(main())
    assert set(informer.known) == {(namespace, "stays"), (namespace, "new")}
