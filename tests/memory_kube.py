"""An in-memory Kubernetes for the operator's logic: the reconciler on a store of objects, its Events collected.

Only for pure logic around the client (which requests, in which order, what status); the real API server,
KubeRay and the operator process are exercised in e2e/.
"""

from __future__ import annotations

import asyncio
import copy
import json
import uuid
from collections.abc import Awaitable, Mapping
from typing import Any

from hybridflow.k8s import names
from hybridflow.k8s.settings import RenderSettings
from hybridflow_operator.machinery.client import ApiException
from hybridflow_operator.machinery.workqueue import WorkQueue
from hybridflow_operator.observed import JobView, Key
from hybridflow_operator.reconciler import Reconciler
from hybridflow_operator.settings import OperatorSettings

NS = "team-a"


def run(coro: Awaitable[Any]) -> Any:
    return asyncio.run(coro)  # type: ignore[arg-type]


def api_error(status: int, body: Mapping[str, Any] | None = None) -> ApiException:
    error = ApiException(status=status, reason="refused")
    error.body = json.dumps(body or {"message": f"refused with {status}"})
    return error


class MemoryKube:
    """Objects by (kind, namespace, name) with resourceVersions; records every request it serves."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict] = {}
        self.requests: list[tuple[str, str, str]] = []
        self.refuse: dict[tuple[str, str], Exception] = {}  # (verb, kind) -> error to raise
        self.urgent: list[tuple[str, str]] = []  # (verb, kind) of the requests sent as urgent
        self._rv = 100

    def put(self, obj: Mapping[str, Any]) -> dict:
        stored = copy.deepcopy(dict(obj))
        self._rv += 1
        meta = stored["metadata"]
        meta.setdefault("uid", str(uuid.uuid4()))
        meta["resourceVersion"] = str(self._rv)
        self.objects[(stored["kind"], meta["namespace"], meta["name"])] = stored
        return copy.deepcopy(stored)

    def _serve(self, verb: str, kind: str, name: str, urgent: bool = False) -> None:
        self.requests.append((verb, kind, name))
        if urgent:
            self.urgent.append((verb, kind))
        if (verb, kind) in self.refuse:
            raise self.refuse[(verb, kind)]

    async def get(self, api_version: str, kind: str, namespace: str, name: str, *,
                  urgent: bool = False) -> dict | None:
        self._serve("get", kind, name, urgent)
        found = self.objects.get((kind, namespace, name))
        return copy.deepcopy(found) if found else None

    async def create(self, obj: Mapping[str, Any], *, urgent: bool = False) -> dict:
        meta = obj["metadata"]
        self._serve("create", obj["kind"], meta["name"], urgent)
        if (obj["kind"], meta["namespace"], meta["name"]) in self.objects:
            raise api_error(409)
        return self.put(obj)

    async def patch(self, api_version: str, kind: str, namespace: str, name: str, body: Any, *,
                    json_patch: bool = False, status: bool = False) -> dict:
        self._serve("patch-status" if status else "patch", kind, name)
        current = self.objects.get((kind, namespace, name))
        if current is None:
            raise api_error(404)
        if json_patch:
            return self.put(apply_json_patch(current, body))
        assert status, "only status patches and JSON patches are modelled"
        if body["metadata"]["resourceVersion"] != current["metadata"]["resourceVersion"]:
            raise api_error(409)
        merged = {k: v for k, v in {**(current.get("status") or {}), **body["status"]}.items() if v is not None}
        return self.put({**current, "status": merged})

    def verbs(self) -> list[tuple[str, str]]:
        return [(verb, kind) for verb, kind, _ in self.requests]


def apply_json_patch(obj: Mapping[str, Any], ops: list[dict]) -> dict:
    """RFC 6902 add/remove/test on a copy, enough for the operator's RayJob patches."""
    out = copy.deepcopy(dict(obj))
    for op in ops:
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        target: Any = out
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        if op["op"] == "test":
            assert target[last] == op["value"], op
        elif op["op"] == "remove":
            del target[last]
        else:
            target[last] = op["value"]
    return out


class Loop:
    """A Reconciler on a MemoryKube, with its Events collected; `gpu_products` goes to the render settings."""

    def __init__(self, kube: MemoryKube, gpu_products: Mapping[str, tuple[str, ...]] | None = None,
                 **settings: Any) -> None:
        self.kube = kube
        self.events: list[tuple[str, str, str]] = []
        if gpu_products is not None:
            settings["render"] = RenderSettings(gpu_products=gpu_products)
        self.reconciler = Reconciler(kube, OperatorSettings(**{"status_min_interval": 0.01, **settings}),  # type: ignore[arg-type]
                                     lambda ref, kind, reason, message: self.events.append((kind, reason, message)))

    def job_event(self, obj: Mapping[str, Any], event_type: str | None) -> None:
        """As the informer delivers it: parsed once into a JobView."""
        self.reconciler.job_event(JobView.parse(obj), event_type)

    def observe_job(self, obj: Mapping[str, Any]) -> Key:
        return self.reconciler.observed.job(JobView.parse(obj))

    def stored_job(self, name: str = "ppo") -> dict:
        return self.kube.objects[("RLTrainingJob", NS, name)]

    def rayjob(self, name: str = "ppo") -> dict | None:
        return self.kube.objects.get(("RayJob", NS, names.rayjob_name(name)))

    async def settle(self) -> None:
        await settle(self.reconciler.queue)


async def settle(queue: WorkQueue[Any], timeout: float = 5.0) -> None:
    """Until the queue has nothing left to do, delayed runs included."""
    deadline = asyncio.get_running_loop().time() + timeout
    await asyncio.sleep(0)
    while not queue.idle:
        assert asyncio.get_running_loop().time() < deadline, "the work queue never went idle"
        await asyncio.sleep(0.005)

