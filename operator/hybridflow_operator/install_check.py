"""`helm test`'s check of an installed chart: the RLTrainingJob CRD is Established and the operator is Available.

    python -m hybridflow_operator.install_check --deployment NAME --namespace NS [--crd NAME] [--timeout S]

The chart's test pod runs it under a ServiceAccount that may only `get` those two objects. It reads both until
both pass or `--timeout` runs out, prints one line per object saying what it found, and exits 1 unless both
passed. The verdicts are pure functions of the objects read (`crd_finding`, `deployment_finding`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kubernetes import client

from hybridflow.api import API_GROUP, PLURAL
from hybridflow_operator.machinery.client import ApiException, api_message, load_configuration

CRD_NAME = f"{PLURAL}.{API_GROUP}"
POLL_S = 2.0
DEFAULT_TIMEOUT_S = 60.0
REQUEST_TIMEOUT_S = 10
PASSED = "the hybridflow chart is installed and its operator is available"


@dataclass(frozen=True)
class Finding:
    """What was found about one object, and whether it passes."""

    what: str
    ok: bool
    detail: str

    def line(self) -> str:
        return f"{'ok  ' if self.ok else 'FAIL'} {self.what}: {self.detail}"


@dataclass(frozen=True)
class Read:
    """One object as read from the API server: the object, or None when it does not exist, or the error."""

    obj: Mapping[str, Any] | None
    error: str | None = None


def _condition(obj: Mapping[str, Any], kind: str) -> Mapping[str, Any]:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c.get("type") == kind), {})


def _condition_text(cond: Mapping[str, Any], kind: str) -> str:
    if not cond:
        return f"no {kind} condition yet"
    why = ": ".join(str(cond[k]) for k in ("reason", "message") if cond.get(k))
    return f"{kind}={cond.get('status')}" + (f" ({why})" if why else "")


def crd_finding(name: str, read: Read) -> Finding:
    """The CRD passes when its Established condition is True: the API server serves the resource."""
    what = f"CustomResourceDefinition {name}"
    if read.error is not None:
        return Finding(what, False, f"cannot read it: {read.error}")
    if read.obj is None:
        return Finding(what, False, "not found (crds.install=false needs it applied separately)")
    cond = _condition(read.obj, "Established")
    served = [v.get("name", "?") for v in (read.obj.get("spec") or {}).get("versions") or [] if v.get("served")]
    detail = _condition_text(cond, "Established") + (f"; serves {', '.join(served)}" if served else "")
    return Finding(what, cond.get("status") == "True", detail)


def deployment_finding(namespace: str, name: str, read: Read) -> Finding:
    """The Deployment passes when its controller has seen the current spec and reports Available=True."""
    what = f"Deployment {namespace}/{name}"
    if read.error is not None:
        return Finding(what, False, f"cannot read it: {read.error}")
    if read.obj is None:
        return Finding(what, False, "not found")
    status = read.obj.get("status") or {}
    generation = (read.obj.get("metadata") or {}).get("generation", 0)
    observed = status.get("observedGeneration", 0)
    replicas = f"{status.get('availableReplicas', 0)}/{(read.obj.get('spec') or {}).get('replicas', 1)} available"
    if observed < generation:
        return Finding(what, False, f"its controller has not seen generation {generation} yet ({replicas})")
    cond = _condition(read.obj, "Available")
    return Finding(what, cond.get("status") == "True", f"{_condition_text(cond, 'Available')}; {replicas}")


def report(findings: Sequence[Finding]) -> tuple[bool, str]:
    """Whether every finding passed, and the lines to print."""
    ok = all(f.ok for f in findings)
    verdict = PASSED if ok else "the check failed"
    return ok, "\n".join([*(f.line() for f in findings), verdict])


# -- I/O edge ---------------------------------------------------------------------------------------------


def _read(call: Callable[..., Any], *args: str) -> Read:
    """One GET through the official client, kept as a plain dict."""
    try:
        response = call(*args, _preload_content=False, _request_timeout=REQUEST_TIMEOUT_S)
    except ApiException as e:
        if e.status == 404:
            return Read(None)
        return Read(None, f"HTTP {e.status}: {api_message(e)}")
    except Exception as e:  # the API server unreachable: a finding, never a traceback
        return Read(None, f"{type(e).__name__}: {e}")
    return Read(json.loads(response.data))


def check_once(api: client.ApiClient, crd: str, namespace: str, deployment: str) -> list[Finding]:
    """Read both objects once and judge them."""
    crd_read = _read(client.ApiextensionsV1Api(api).read_custom_resource_definition, crd)
    deployment_read = _read(client.AppsV1Api(api).read_namespaced_deployment, deployment, namespace)
    return [crd_finding(crd, crd_read), deployment_finding(namespace, deployment, deployment_read)]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m hybridflow_operator.install_check",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--crd", default=CRD_NAME, help=f"CustomResourceDefinition name ({CRD_NAME})")
    parser.add_argument("--deployment", required=True, help="the operator Deployment's name")
    parser.add_argument("--namespace", required=True, help="the operator Deployment's namespace")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help=f"seconds to wait for both to pass ({DEFAULT_TIMEOUT_S:.0f})")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        configuration = load_configuration()
    except Exception as e:
        print(f"install_check: no Kubernetes credentials (in-cluster or kubeconfig): {e}", file=sys.stderr)
        return 1
    deadline = time.monotonic() + args.timeout
    with client.ApiClient(configuration) as api:
        while True:
            ok, text = report(check_once(api, args.crd, args.namespace, args.deployment))
            if ok or time.monotonic() >= deadline:
                print(text)
                return 0 if ok else 1
            time.sleep(POLL_S)


if __name__ == "__main__":
    sys.exit(main())
