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
TEST_TIMEOUT_S = 120.0


class HelmError(RuntimeError):
    """helm failed; the message has its output."""


def helm_binary() -> str | None:
    found = binaries.find("helm") or shutil.which("helm")
    return str(found) if found else None


def helm(kube: KubectlClient, *args: str, timeout: float = INSTALL_TIMEOUT_S, with_stderr: bool = False) -> str:
    """helm's stdout (and its stderr after it, with_stderr: where helm writes hook pods' logs)."""
    binary = helm_binary()
    if binary is None:
        raise HelmError("helm not found: run `bash e2e/toolchain/build.sh helm` (needs Go) or put helm on PATH")
    cmd = [binary, f"--kubeconfig={kube.kubeconfig}", *args]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if result.returncode != 0:
        raise HelmError(f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stderr}{result.stdout}")
    return result.stdout + result.stderr if with_stderr else result.stdout


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


def run_helm_test(kube: KubectlClient, release: str, namespace: str, timeout: float = TEST_TIMEOUT_S) -> str:
    """`helm test`: the chart's test pod (operator image, python -m hybridflow_operator.install_check) finds the
    CRD Established and the operator Deployment Available. Raises HelmError when it fails; returns what helm
    printed, the pod's report included (Helm prints it itself: helm.sh/hook-output-log-policy).

    Without --logs: the pod is deleted once it passed (hook-succeeded), and `--logs` reads the logs only after
    that, so it would fail a passed test (helm/helm#9098)."""
    out = helm(kube, "test", release, "-n", namespace, f"--timeout={int(timeout)}s", timeout=timeout + 30,
               with_stderr=True)
    if "Phase:          Succeeded" not in out:
        raise HelmError(f"helm test {release} passed without a succeeded test:\n{out}")
    return out
