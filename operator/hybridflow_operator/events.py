"""Kubernetes Events about RLTrainingJobs, posted through the operator's own client.

kopf's Event poster takes its queue from a context variable that kopf sets only inside its resource
handlers; with every watch in the informers there is no such context, so the Events go out here, as
kopf would write them (a core/v1 Event that `kubectl describe` shows), without waiting for the answer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import aiohttp

from hybridflow.k8s import contract
from hybridflow_operator.machinery.client import FIELD_MANAGER, ApiException, Kube, api_message, namespace_terminating

MAX_MESSAGE = 1024  # what kopf posts at most; the API server refuses far longer ones
log = logging.getLogger(__name__)


def event_body(ref: Mapping[str, Any], event_type: str, reason: str, message: str, now: str) -> dict:
    """A core/v1 Event about the object `ref` names (apiVersion, kind, metadata name/namespace/uid)."""
    meta = ref["metadata"]
    if len(message) > MAX_MESSAGE:
        message = message[:MAX_MESSAGE - 3] + "..."
    return {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"namespace": meta["namespace"], "generateName": f"{meta['name']}."},
        "involvedObject": {"apiVersion": ref["apiVersion"], "kind": ref["kind"], "name": meta["name"],
                           "namespace": meta["namespace"], "uid": meta.get("uid")},
        "type": event_type, "reason": reason, "message": message,
        "source": {"component": FIELD_MANAGER}, "reportingComponent": FIELD_MANAGER,
        "firstTimestamp": now, "lastTimestamp": now, "count": 1,
    }


class EventPoster:
    """`poster(ref, Normal|Warning, reason, message)`; Normal Events only when `level` is INFO or lower."""

    def __init__(self, kube: Kube, level: int) -> None:
        self.kube = kube
        self.level = level
        self._pending: set[asyncio.Task[None]] = set()

    def __call__(self, ref: Mapping[str, Any], event_type: str, reason: str, message: str) -> None:
        if self.level > (logging.WARNING if event_type == "Warning" else logging.INFO):
            return
        body = event_body(ref, event_type, reason, message, contract.timestamp())
        task = asyncio.get_running_loop().create_task(self._post(body), name=f"event {reason}")
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _post(self, body: dict) -> None:
        try:
            await self.kube.create(body)
        except (ApiException, aiohttp.ClientError, TimeoutError) as e:  # an Event is auxiliary: note and go on
            if namespace_terminating(e):  # the job goes with its namespace, and so would the Event
                log.debug("no Event %s about %s: its namespace is being deleted", body["reason"],
                          body["involvedObject"]["name"])
                return
            detail = api_message(e) if isinstance(e, ApiException) else repr(e)
            log.warning("could not post Event %s about %s: %s", body["reason"], body["involvedObject"]["name"], detail)

    async def close(self) -> None:
        """Let the Events already handed over go out (a second at most)."""
        if self._pending:
            await asyncio.wait(self._pending, timeout=1.0)
