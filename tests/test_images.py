"""docker/build-images.sh's input keys and archive names, and the parsing in e2e/harness/images.py: what
decides whether an image is rebuilt and reimported, checked without building anything."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from e2e.harness import images

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A repository with the real docker/ and chart metadata and a stub of the Python sources."""
    root = tmp_path / "repo"
    shutil.copytree(ROOT / "docker", root / "docker")
    (root / "charts" / "hybridflow").mkdir(parents=True)
    shutil.copy(ROOT / "charts" / "hybridflow" / "Chart.yaml", root / "charts" / "hybridflow" / "Chart.yaml")
    shutil.copy(ROOT / ".dockerignore", root / ".dockerignore")
    (root / "pyproject.toml").write_text("[project]\nname = 'stub'\n")
    for package in ("runtime/hybridflow", "operator/hybridflow_operator"):
        (root / package).mkdir(parents=True)
        (root / package / "__init__.py").write_text("")
    return root


def script(repo: Path, *args: str) -> str:
    """build-images.sh of that repository, with its cache beside it."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(repo.parent), "HYBRIDFLOW_CACHE": str(repo.parent / "cache")}
    out = subprocess.run(["bash", str(repo / "docker" / "build-images.sh"), *args], env=env, check=True,
                         capture_output=True, text=True, timeout=60)
    return out.stdout.strip()


def keys(repo: Path, *names: str) -> dict[str, str]:
    return {name: script(repo, "--key", name) for name in names}


def test_key_is_stable(repo: Path) -> None:
    assert keys(repo, "operator", "runtime-cpu") == keys(repo, "operator", "runtime-cpu")


def test_changed_dockerfile_changes_its_key_and_its_dependents(repo: Path) -> None:
    before = keys(repo, "python-slim", "operator", "ray-cpu", "runtime-cpu", "node-base")
    with (repo / "docker" / "base" / "python-slim.Dockerfile").open("a") as f:
        f.write("ENV CHANGED=1\n")
    after = keys(repo, *before)
    assert {n for n in before if before[n] != after[n]} == {"python-slim", "operator", "ray-cpu", "runtime-cpu"}


def test_changed_copied_file_changes_the_key(repo: Path) -> None:
    before = keys(repo, "operator", "runtime-cpu", "node-base")
    (repo / "runtime" / "hybridflow" / "__init__.py").write_text("VERSION = 2\n")
    after = keys(repo, *before)
    assert after["operator"] != before["operator"]
    assert after["runtime-cpu"] != before["runtime-cpu"]
    assert after["node-base"] == before["node-base"]  # copies nothing from the repository


def test_bytecode_leaves_the_key_alone(repo: Path) -> None:
    before = keys(repo, "operator")
    cache = repo / "operator" / "hybridflow_operator" / "__pycache__"
    cache.mkdir()
    (cache / "x.cpython-311.pyc").write_bytes(b"\0")
    assert keys(repo, "operator") == before


def test_archive_is_named_by_image_and_key(repo: Path) -> None:
    key = script(repo, "--key", "runtime-cpu")
    archive = Path(script(repo, "--archive", "runtime-cpu"))
    assert archive == repo.parent / "cache" / "images" / f"runtime-cpu-{key}.tar"
    assert images.archive_key(archive) == key


def test_list_names_the_node_images(repo: Path) -> None:
    refs = dict(line.split("\t") for line in script(repo, "--list").splitlines())
    assert set(images.NODE_IMAGES) <= set(refs)
    assert refs["runtime-cpu"] == "docker.io/hybridflow/runtime:0.1.0-cpu"
    assert refs["operator"] == "docker.io/hybridflow/operator:0.1.0"
    assert refs["pause"] == "registry.k8s.io/pause:3.6"


def test_parse_results() -> None:
    fields = ["runtime-cpu", "docker.io/hybridflow/runtime:0.1.0-cpu", "/c/runtime-cpu-ab.tar", "10", "7", "built"]
    line = "\t".join(fields)
    out = f"build-images: noise\n{line}\n"
    (image,) = images.parse_results(out).values()
    assert image == images.BuiltImage("runtime-cpu", "docker.io/hybridflow/runtime:0.1.0-cpu",
                                      Path("/c/runtime-cpu-ab.tar"), 10, 7, cached=False)


@pytest.mark.parametrize(("ref", "normal"), [
    ("busybox:1", "docker.io/library/busybox:1"),
    ("hybridflow/runtime:0.1.0", "docker.io/hybridflow/runtime:0.1.0"),
    ("docker.io/hybridflow/runtime:0.1.0", "docker.io/hybridflow/runtime:0.1.0"),
    ("registry.k8s.io/pause:3.6", "registry.k8s.io/pause:3.6"),
    ("localhost/hybridflow/debian:bookworm-minbase", "localhost/hybridflow/debian:bookworm-minbase"),
])
def test_normalize(ref: str, normal: str) -> None:
    assert images.normalize(ref) == normal
