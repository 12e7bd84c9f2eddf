"""The project's Helm chart installed with the helm built from its Go module (or PATH's)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from . import binaries
from .controlplane import KubectlClient

CHART = Path(__file__).resolve().parents[2] / "charts" / "hybridflow"
CRD_NAME = "rltrainingjobs.hybridflow.io"
INSTALL_TIMEOUT_S = 180.0


class HelmError(RuntimeError):
    """helm failed; the message has its output."""


def helm_binary() -> str | None:
    found = binaries.find("helm") or shutil.which("helm")
    return str(found) if found else None


def helm(kube: KubectlClient, *args: str, timeout: float = INSTALL_TIMEOUT_S) -> str:
    binary = helm_binary()
    if binary is None:
        raise HelmError("helm not found: run `bash e2e/toolchain/build.sh helm` (needs Go) or put helm on PATH")
    cmd = [binary, f"--kubeconfig={kube.kubeconfig}", *args]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if result.returncode != 0:
        raise HelmError(f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stderr}{result.stdout}")
    return result.stdout


def install_chart(kube: KubectlClient, release: str, namespace: str, values: Mapping[str, Any] | None = None,
                  timeout: float = INSTALL_TIMEOUT_S) -> None:
    """helm upgrade --install the chart, CRD included; a CRD applied before (the harness installs crds/) is
    adopted by the release. `values` go in as a values file; --wait: the operator pod is up."""
    if kube.kubectl("get", "crd", CRD_NAME, check=False).returncode == 0:
        kube.kubectl("label", "crd", CRD_NAME, "app.kubernetes.io/managed-by=Helm", "--overwrite")
        kube.kubectl("annotate", "crd", CRD_NAME, f"meta.helm.sh/release-name={release}",
                     f"meta.helm.sh/release-namespace={namespace}", "--overwrite")
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as values_file:
        yaml.safe_dump(dict(values or {}), values_file)
        values_file.flush()
        helm(kube, "upgrade", "--install", release, str(CHART), "--namespace", namespace, "--create-namespace",
             "--wait", f"--timeout={int(timeout)}s", "-f", values_file.name, timeout=timeout + 30)
