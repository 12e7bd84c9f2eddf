"""The version is written once (runtime/hybridflow/_version.py), and everything that carries it agrees: the
distribution's metadata, both packages, the CLIs, the default runtime image, the Helm chart. Also what the
wheel ships: both console scripts and both packages' py.typed."""

from __future__ import annotations

import email
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile

import pytest
import yaml

import hybridflow
import hybridflow_operator
from hybridflow._version import __version__
from hybridflow.k8s.settings import DEFAULT_RUNTIME_IMAGE
from tests.conftest import ROOT

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_packages_export_the_one_version() -> None:
    assert re.fullmatch(r"\d+\.\d+\.\d+([.-]?\w+)*", __version__)
    assert hybridflow.__version__ == hybridflow_operator.__version__ == __version__


def test_pyproject_reads_the_version_from_the_package() -> None:
    project = PYPROJECT["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "hybridflow._version.__version__"}


def test_the_chart_and_the_default_runtime_image_carry_the_version() -> None:
    chart = yaml.safe_load((ROOT / "charts" / "hybridflow" / "Chart.yaml").read_text())
    assert (chart["version"], chart["appVersion"]) == (__version__, __version__), (
        "bump charts/hybridflow/Chart.yaml's version and appVersion with runtime/hybridflow/_version.py")
    assert f"docker.io/hybridflow/runtime:{__version__}" == DEFAULT_RUNTIME_IMAGE


def test_no_other_python_module_writes_the_version() -> None:
    literal = re.compile(rf"""["']{re.escape(__version__)}["']""")
    sources = [*(ROOT / "runtime").rglob("*.py"), *(ROOT / "operator").rglob("*.py")]
    writers = [str(p.relative_to(ROOT)) for p in sources if literal.search(p.read_text())]
    assert writers == ["runtime/hybridflow/_version.py"]


@pytest.mark.parametrize("prog", ["hybridflow", "hybridflow_operator"])
def test_both_commands_print_the_version(prog: str) -> None:
    out = subprocess.run([sys.executable, "-m", prog, "--version"], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"{prog.replace('_', '-')} {__version__}"


def test_console_scripts_and_type_markers_are_declared() -> None:
    assert PYPROJECT["project"]["scripts"] == {"hybridflow": "hybridflow.cli:main",
                                               "hybridflow-operator": "hybridflow_operator.__main__:main"}
    data = PYPROJECT["tool"]["setuptools"]["package-data"]
    for package, where in (("hybridflow", "runtime"), ("hybridflow_operator", "operator")):
        assert "py.typed" in data[package]
        assert (ROOT / where / package / "py.typed").is_file()
    from hybridflow_operator.__main__ import main

    assert callable(main)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    """The wheel built from a copy of the sources (so no build files land in the checkout), without isolation:
    the dev environment's setuptools, no network."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for tree in ("runtime", "operator"):
        shutil.copytree(ROOT / tree, src / tree, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    out = src / "dist"
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(out), str(src)], capture_output=True, text=True, timeout=600)
    if built.returncode != 0:
        pytest.fail(f"building the wheel failed:\n{built.stdout[-3000:]}\n{built.stderr[-3000:]}")
    [path] = out.glob("hybridflow-*.whl")
    return zipfile.ZipFile(path)


def test_the_wheel_has_the_version_both_scripts_and_both_type_markers(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    dist_info = f"hybridflow-{__version__}.dist-info"
    metadata = email.message_from_bytes(wheel.read(f"{dist_info}/METADATA"))
    assert metadata["Version"] == __version__
    entry_points = wheel.read(f"{dist_info}/entry_points.txt").decode()
    assert "hybridflow = hybridflow.cli:main" in entry_points
    assert "hybridflow-operator = hybridflow_operator.__main__:main" in entry_points
    assert {"hybridflow/py.typed", "hybridflow_operator/py.typed", "hybridflow/_version.py"} <= names
