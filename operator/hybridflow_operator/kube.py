"""A small synchronous Kubernetes client for the few kinds the operator touches, on plain dicts.

Paths come from a fixed table instead of API discovery, so the client works the moment the
operator starts, whatever CRDs appear later.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from hybridflow.api import API_GROUP, API_VERSION, KIND, PLURAL

# (apiVersion, kind) -> plural
PLURALS = {
    ("v1", "ConfigMap"): "configmaps",
    ("v1", "ServiceAccount"): "serviceaccounts",
    ("v1", "Pod"): "pods",
    ("rbac.authorization.k8s.io/v1", "Role"): "roles",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "rolebindings",
    ("ray.io/v1", "RayJob"): "rayjobs",
    (f"{API_GROUP}/{API_VERSION}", KIND): PLURAL,
}
JOB_API_VERSION = f"{API_GROUP}/{API_VERSION}"
MERGE = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
FIELD_MANAGER = "hybridflow-operator"
TIMEOUT_S = 30

__all__ = ["JOB_API_VERSION", "ApiException", "Kube", "load_config"]


def load_config() -> None:
    """In-cluster credentials when running in a pod, else the kubeconfig (KUBECONFIG or ~/.kube/config)."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()


def _path(api_version: str, kind: str, namespace: str, name: str | None = None, sub: str | None = None) -> str:
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{prefix}/namespaces/{namespace}/{PLURALS[(api_version, kind)]}"
    if name:
        path += f"/{name}"
    if sub:
        path += f"/{sub}"
    return path


class Kube:
    """get / create / patch / list by (apiVersion, kind, namespace, name); raises ApiException."""

    def __init__(self, api: client.ApiClient | None = None) -> None:
        self.api = api or client.ApiClient()

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None:
        try:
            return self._call("GET", _path(api_version, kind, namespace, name))
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def create(self, obj: Mapping[str, Any]) -> dict:
        meta = obj["metadata"]
        return self._call("POST", _path(obj["apiVersion"], obj["kind"], meta["namespace"]), body=obj,
                          query=[("fieldManager", FIELD_MANAGER)])

    def patch(self, api_version: str, kind: str, namespace: str, name: str, body: Any, *,
              json_patch: bool = False, status: bool = False) -> dict:
        return self._call("PATCH", _path(api_version, kind, namespace, name, "status" if status else None),
                          body=body, content_type=JSON_PATCH if json_patch else MERGE,
                          query=[("fieldManager", FIELD_MANAGER)])

    def list(self, api_version: str, kind: str, namespace: str, label_selector: str) -> list[dict]:
        found = self._call("GET", _path(api_version, kind, namespace), query=[("labelSelector", label_selector)])
        return found.get("items") or []

    def version(self) -> dict:
        """The API server's version: a cheap request every authenticated client may make."""
        return self._call("GET", "/version")

    def _call(self, method: str, path: str, *, body: Any = None, content_type: str = "application/json",
              query: list[tuple[str, str]] | None = None) -> dict:
        request = self.api.param_serialize(
            method, path, query_params=query or [], header_params={"Accept": "application/json",
                                                                    "Content-Type": content_type},
            body=body, auth_settings=["BearerToken"],
        )
        response = self.api.call_api(*request, _request_timeout=TIMEOUT_S)
        response.read()
        if not 200 <= response.status <= 299:
            raise ApiException.from_response(http_resp=response, body=response.data.decode(errors="replace"),
                                             data=None)
        return json.loads(response.data) if response.data else {}
