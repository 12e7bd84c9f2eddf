"""A small asynchronous Kubernetes client for the few kinds the operator touches, on plain dicts.

It shares kopf's event loop, so no request ever waits for a thread. Paths come from a fixed table
instead of API discovery, so the client works the moment the operator starts, whatever CRDs appear
later. Credentials come from the official client's loaders (in-cluster or kubeconfig), whose hook
re-reads a rotated service-account token.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import aiohttp
import orjson
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from hybridflow.api import KIND, PLURAL
from hybridflow.k8s.names import JOB_API_VERSION
from hybridflow_operator.machinery.slots import PrioritySlots

# (apiVersion, kind) -> plural
PLURALS = {
    ("v1", "ConfigMap"): "configmaps",
    ("v1", "ServiceAccount"): "serviceaccounts",
    ("v1", "Pod"): "pods",
    ("v1", "Event"): "events",
    ("rbac.authorization.k8s.io/v1", "Role"): "roles",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "rolebindings",
    ("networking.k8s.io/v1", "NetworkPolicy"): "networkpolicies",
    ("ray.io/v1", "RayJob"): "rayjobs",
    (JOB_API_VERSION, KIND): PLURAL,
}
MERGE = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
FIELD_MANAGER = "hybridflow-operator"
TIMEOUT_S = 30
WATCH_SILENCE_S = 120  # a watch asks for bookmarks, which the API server sends about once a minute
RequestHook = Callable[[str, int | None], None]
"""Told of every request: its verb (get, list, watch, create, patch) and HTTP status, None without an answer."""

UNREACHABLE = (aiohttp.ClientError, TimeoutError)
"""What a request raises when no answer came: the API server is down, restarting or out of reach."""
REQUEST_FAILED = (ApiException, aiohttp.ClientError, TimeoutError)
"""What a request raises when it failed: the API server refused it, or no answer came (UNREACHABLE)."""

__all__ = ["REQUEST_FAILED", "UNREACHABLE", "ApiException", "Kube", "failure", "load_configuration",
           "namespace_terminating"]


def load_configuration() -> client.Configuration:
    """In-cluster credentials when running in a pod, else the kubeconfig (KUBECONFIG or ~/.kube/config)."""
    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
    except config.ConfigException:
        config.load_kube_config(client_configuration=configuration)
    return configuration


def namespace_terminating(e: BaseException) -> bool:
    """A create refused because the namespace is being deleted: the job goes with it, nothing to retry.

    403 Forbidden from the API server's NamespaceLifecycle admission, with the cause NamespaceTerminating
    (or, from servers that add no cause, its message "... because it is being terminated").
    """
    if not isinstance(e, ApiException) or e.status != 403:
        return False
    try:
        body = json.loads(e.body or "{}")
    except ValueError:
        return False
    if not isinstance(body, dict):
        return False
    causes = (body.get("details") or {}).get("causes") or []
    return (any(c.get("reason") == "NamespaceTerminating" for c in causes)
            or "because it is being terminated" in str(body.get("message") or ""))


def failure(e: BaseException) -> str:
    """What went wrong with a request, for a log line: the API server's answer, or that none came."""
    return f"API error {e.status}: {api_message(e)}" if isinstance(e, ApiException) else f"no answer: {e!r}"


def api_message(e: ApiException) -> str:
    try:
        return json.loads(e.body or "{}").get("message") or str(e.reason)
    except ValueError:
        return str(e.reason)


def _path(api_version: str, kind: str, namespace: str, name: str | None = None, sub: str | None = None) -> str:
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{prefix}/namespaces/{namespace}/{PLURALS[(api_version, kind)]}"
    if name:
        path += f"/{name}"
    if sub:
        path += f"/{sub}"
    return path


class JsonLines:
    """A watch stream cut into its events: one JSON document per line, lines of any length across chunks."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, chunk: bytes) -> list[dict]:
        """The documents `chunk` completes; a partial last line waits for the next chunk."""
        self._buffer += chunk
        docs, start = [], 0
        while (end := self._buffer.find(b"\n", start)) >= 0:
            if self._buffer[start:end].strip():
                docs.append(orjson.loads(self._buffer[start:end]))
            start = end + 1
        del self._buffer[:start]
        return docs


def _refusal(response: aiohttp.ClientResponse, body: bytes) -> ApiException:
    """The API server's answer to a refused request, as the Kubernetes client raises it."""
    error = ApiException(status=response.status, reason=response.reason)
    error.body = body.decode(errors="replace")
    return error


def _ssl_context(configuration: client.Configuration) -> ssl.SSLContext | bool:
    if not configuration.verify_ssl:
        return False
    context = ssl.create_default_context(cafile=configuration.ssl_ca_cert)
    if configuration.cert_file:
        context.load_cert_chain(configuration.cert_file, configuration.key_file)
    return context


class Kube:
    """get / create / patch by (apiVersion, kind, namespace, name), list and watch by path; raises ApiException.

    At most `max_connections` requests are in flight; the rest wait for a slot, so a burst of jobs
    queues in the client instead of opening hundreds of TLS connections to the API server. An `urgent`
    request waits ahead of the others (see slots.py). Watch streams have connections of their own,
    outside that limit.
    """

    def __init__(self, configuration: client.Configuration, max_connections: int = 32,
                 on_request: RequestHook | None = None) -> None:
        self.configuration = configuration
        self.on_request = on_request
        self.slots = PrioritySlots(max_connections)
        self._session: aiohttp.ClientSession | None = None
        self._watch_session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:  # created lazily: it binds to the running event loop
            self._session = self._new_session(self.slots.limit, aiohttp.ClientTimeout(total=TIMEOUT_S))
        return self._session

    @property
    def watch_session(self) -> aiohttp.ClientSession:
        if self._watch_session is None:  # a stream lasts minutes; only a silent connection times out
            self._watch_session = self._new_session(0, aiohttp.ClientTimeout(total=None, sock_connect=TIMEOUT_S,
                                                                             sock_read=WATCH_SILENCE_S))
        return self._watch_session

    def _new_session(self, limit: int, timeout: aiohttp.ClientTimeout) -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(limit=limit, ssl=_ssl_context(self.configuration))
        return aiohttp.ClientSession(base_url=self.configuration.host.rstrip("/") + "/", connector=connector,
                                     timeout=timeout)

    async def close(self) -> None:
        for session in (self._session, self._watch_session):
            if session is not None:
                await session.close()
        self._session = self._watch_session = None

    async def get(self, api_version: str, kind: str, namespace: str, name: str, *,
                  urgent: bool = False) -> dict | None:
        try:
            return await self._call("GET", _path(api_version, kind, namespace, name), verb="get", urgent=urgent)
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    async def create(self, obj: Mapping[str, Any], *, urgent: bool = False) -> dict:
        meta = obj["metadata"]
        return await self._call("POST", _path(obj["apiVersion"], obj["kind"], meta["namespace"]), body=obj,
                                params={"fieldManager": FIELD_MANAGER}, verb="create", urgent=urgent)

    async def patch(self, api_version: str, kind: str, namespace: str, name: str, body: Any, *,
                    json_patch: bool = False, status: bool = False) -> dict:
        return await self._call("PATCH", _path(api_version, kind, namespace, name, "status" if status else None),
                                body=body, content_type=JSON_PATCH if json_patch else MERGE,
                                params={"fieldManager": FIELD_MANAGER}, verb="patch")

    async def list_page(self, path: str, params: Mapping[str, str]) -> dict:
        """One page of a LIST by path (`/api/v1/pods`), as the API server sends it: items, metadata."""
        return await self._call("GET", path, params=params, verb="list")

    async def watch(self, path: str, params: Mapping[str, str]) -> AsyncIterator[dict]:
        """The events of a WATCH by path, decoded, until the server ends the stream; ApiException if refused."""
        answered = False
        try:
            async with self.watch_session.get(path.lstrip("/"), params={**params, "watch": "true"},
                                              headers=self._headers("application/json")) as response:
                answered = True
                self._told("watch", response.status)
                if response.status != 200:
                    raise _refusal(response, await response.read())
                lines = JsonLines()
                async for chunk in response.content.iter_any():
                    for event in lines.feed(chunk):
                        yield event
        except (aiohttp.ClientError, TimeoutError):
            if not answered:
                self._told("watch", None)
            raise

    async def _call(self, method: str, path: str, *, verb: str, body: Any = None,
                    content_type: str = "application/json", params: Mapping[str, str] | None = None,
                    urgent: bool = False) -> dict:
        payload = None if body is None else orjson.dumps(body)
        answered = False
        try:
            async with self.slots.slot(urgent), self.session.request(
                    method, path.lstrip("/"), data=payload, headers=self._headers(content_type),
                    params=params) as response:
                answered = True
                self._told(verb, response.status)
                data = await response.read()
                if not 200 <= response.status <= 299:
                    raise _refusal(response, data)
        except (aiohttp.ClientError, TimeoutError):
            if not answered:
                self._told(verb, None)
            raise
        return orjson.loads(data) if data else {}

    def _told(self, verb: str, code: int | None) -> None:
        if self.on_request is not None:
            self.on_request(verb, code)

    def _headers(self, content_type: str) -> dict[str, str]:
        headers = {"Accept": "application/json", "Content-Type": content_type}
        token = self.configuration.get_api_key_with_prefix("BearerToken", alias="authorization")  # refresh hook runs
        if token:
            headers["Authorization"] = token
        return headers
