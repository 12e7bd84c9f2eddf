"""Client-side clocks for the operator benchmark: watches that timestamp objects as a client sees them.

Events are read as plain JSON (no model deserialisation), so a thousand pods cost the benchmark little
CPU on the same cores as the control plane it measures.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

RAY_POD_SELECTOR = "ray.io/node-type"  # head and worker pods of a RayCluster (not the submitter Job's pod)


@dataclass
class Seen:
    """name -> local time of the first event that satisfied a predicate."""

    first: dict[str, float] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    changed: threading.Condition = field(init=False)

    def __post_init__(self) -> None:
        self.changed = threading.Condition(self.lock)

    def mark(self, name: str, when: float) -> None:
        with self.lock:
            if name not in self.first:
                self.first[name] = when
                self.changed.notify_all()

    def count(self) -> int:
        with self.lock:
            return len(self.first)

    def wait_for(self, n: int, timeout: float) -> bool:
        """Block until `n` names were seen, or `timeout` seconds pass."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while len(self.first) < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.changed.wait(min(left, 1.0))
        return True

    def snapshot(self) -> dict[str, float]:
        with self.lock:
            return dict(self.first)


class Watcher:
    """One namespaced watch in a thread, restarted from the last resourceVersion every few seconds."""

    def __init__(
        self,
        name: str,
        list_fn: Callable[..., Any],
        args: tuple[Any, ...],
        on_event: Callable[[str, Mapping[str, Any], float], None],
        label_selector: str | None = None,
    ) -> None:
        self.name = name
        self.list_fn = list_fn
        self.args = args
        self.on_event = on_event
        self.label_selector = label_selector
        self.events = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"watch-{name}", daemon=True)

    def start(self, timeout: float = 30.0) -> Watcher:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError(f"watch {self.name} did not start: {self.errors[-1:]}")
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _kwargs(self) -> dict[str, Any]:
        return {"label_selector": self.label_selector} if self.label_selector else {}

    def _initial_version(self) -> str:
        listed = self.list_fn(*self.args, _preload_content=False, **self._kwargs())
        body = json.loads(listed.data)
        now = time.time()
        for item in body.get("items") or []:
            self.on_event("ADDED", item, now)
        return str(body["metadata"]["resourceVersion"])

    def _run(self) -> None:
        version: str | None = None
        while not self._stop.is_set():
            try:
                if version is None:
                    version = self._initial_version()
                    self._ready.set()
                w = watch.Watch()
                for ev in w.stream(self.list_fn, *self.args, resource_version=version, timeout_seconds=5,
                                   allow_watch_bookmarks=True, deserialize=False, **self._kwargs()):
                    now = time.time()
                    obj = ev["object"]
                    if ev["type"] == "ERROR":
                        if obj.get("code") == 410:
                            version = None  # too old: list again
                        break
                    version = obj["metadata"].get("resourceVersion") or version
                    if ev["type"] != "BOOKMARK":
                        self.events += 1
                        self.on_event(ev["type"], obj, now)
                    if self._stop.is_set():
                        w.stop()
                        break
            except ApiException as e:
                self.errors.append(f"{e.status} {e.reason}")
                if e.status == 410:
                    version = None
                time.sleep(0.5)
            except Exception as e:  # connection resets under load: note and reconnect
                self.errors.append(repr(e))
                time.sleep(0.5)


class NamespaceTracker:
    """Timestamps, in one namespace: RLTrainingJobs and RayJobs first seen, Ray pods first seen bound."""

    def __init__(self, api: client.ApiClient, namespace: str) -> None:
        self.namespace = namespace
        self.jobs = Seen()
        self.rayjobs = Seen()
        self.pods_created = Seen()
        self.pods_bound = Seen()
        self.bound_nodes: dict[str, str] = {}
        custom = client.CustomObjectsApi(api)
        core = client.CoreV1Api(api)
        self.watchers = [
            Watcher("rltrainingjobs", custom.list_namespaced_custom_object,
                    ("hybridflow.io", "v1alpha1", namespace, "rltrainingjobs"), self._on_job),
            Watcher("rayjobs", custom.list_namespaced_custom_object, ("ray.io", "v1", namespace, "rayjobs"),
                    self._on_rayjob),
            Watcher("pods", core.list_namespaced_pod, (namespace,), self._on_pod, label_selector=RAY_POD_SELECTOR),
        ]

    def start(self) -> NamespaceTracker:
        for w in self.watchers:
            w.start()
        return self

    def stop(self) -> None:
        for w in self.watchers:
            with contextlib.suppress(Exception):
                w.stop()

    def errors(self) -> dict[str, list[str]]:
        return {w.name: w.errors[-5:] for w in self.watchers if w.errors}

    def _on_job(self, kind: str, obj: Mapping[str, Any], now: float) -> None:
        if kind == "ADDED":
            self.jobs.mark(obj["metadata"]["name"], now)

    def _on_rayjob(self, kind: str, obj: Mapping[str, Any], now: float) -> None:
        if kind in ("ADDED", "MODIFIED"):
            self.rayjobs.mark(obj["metadata"]["name"], now)

    def _on_pod(self, kind: str, obj: Mapping[str, Any], now: float) -> None:
        if kind == "DELETED":
            return
        name = obj["metadata"]["name"]
        self.pods_created.mark(name, now)
        node = (obj.get("spec") or {}).get("nodeName")
        if node:
            self.bound_nodes.setdefault(name, node)
            self.pods_bound.mark(name, now)
