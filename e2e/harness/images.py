"""The project's container images for a real node: built by docker/build-images.sh (buildah, no Docker
engine, no registry) and imported into containerd with ctr, where the kubelet finds them (pods use
imagePullPolicy IfNotPresent).

    archives = build_images(NODE_IMAGES)          # {"runtime-cpu": Path(".../runtime-cpu-<key>.tar"), ...}
    import_images("/run/…/containerd.sock", archives.values())
"""

from __future__ import annotations

import json
import subprocess
import tarfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "docker" / "build-images.sh"
NAMESPACE = "k8s.io"  # the containerd namespace the CRI plugin, and so the kubelet, reads
KEY_LABEL = "io.hybridflow.image-key"  # also on each image's config (build-images.sh)
BUILD_TIMEOUT_S = 2 * 3600  # a cold build of every image downloads torch: well under an hour here
IMPORT_TIMEOUT_S = 1800

# Names docker/build-images.sh knows (`--list` gives each one's reference).
PAUSE = "pause"  # registry.k8s.io/pause:3.6, containerd 1.6's default sandbox_image
NODE_BASE = "node-base"  # Debian with no Python: pods mount the host's Python and venv
OPERATOR = "operator"  # the chart's default image
RUNTIME_CPU = "runtime-cpu"  # for the chart's runtimeImage on CPU-only nodes
NODE_IMAGES = (PAUSE, NODE_BASE, OPERATOR, RUNTIME_CPU)


class ImageError(RuntimeError):
    """Raised when a build or an import fails, with the tool's output."""


@dataclass(frozen=True)
class BuiltImage:
    """One line of build-images.sh's output."""

    name: str
    ref: str
    archive: Path
    size: int  # bytes of the archive
    seconds: int  # build time; 0 when the archive was already there
    cached: bool


def parse_results(stdout: str) -> dict[str, BuiltImage]:
    """build-images.sh's tab-separated lines by image name (the bases it built along come too)."""
    images: dict[str, BuiltImage] = {}
    for line in stdout.splitlines():
        fields = line.split("\t")
        if len(fields) != 6:
            continue
        name, ref, archive, size, seconds, state = fields
        images[name] = BuiltImage(name, ref, Path(archive), int(size), int(seconds), state == "cached")
    return images


def _script(*args: str, timeout: float, stderr: int | None = None) -> str:
    """Run build-images.sh; its stdout, or ImageError."""
    proc = subprocess.run(["bash", str(SCRIPT), *args], stdout=subprocess.PIPE, stderr=stderr, text=True,
                          timeout=timeout, check=False)
    if proc.returncode != 0:
        raise ImageError(f"build-images.sh {' '.join(args)} exited {proc.returncode}: {proc.stderr or ''}")
    return proc.stdout


def build(names: Sequence[str] = (), timeout: float = BUILD_TIMEOUT_S) -> dict[str, BuiltImage]:
    """Build the images asked (all when none), skipping those whose inputs have not changed; buildah's
    output goes to this process's stderr."""
    return parse_results(_script(*names, timeout=timeout))


def build_images(names: Sequence[str] = (), timeout: float = BUILD_TIMEOUT_S) -> dict[str, Path]:
    """Image name -> docker-archive, for the images asked and the bases built along."""
    return {name: image.archive for name, image in build(names, timeout).items()}


def image_refs() -> dict[str, str]:
    """Image name -> reference (docker.io/hybridflow/runtime:0.1.0-cpu), without building."""
    out = _script("--list", timeout=60, stderr=subprocess.PIPE)
    return dict(line.split("\t", 1) for line in out.splitlines() if "\t" in line)


def archive_key(archive: Path) -> str:
    """The input key in an archive's name, <image>-<key>.tar."""
    return archive.name.removesuffix(".tar").rsplit("-", 1)[-1]


def archive_refs(archive: Path) -> list[str]:
    """The references a docker-archive tags (its manifest.json's RepoTags)."""
    with tarfile.open(archive) as tar:
        member = tar.extractfile("manifest.json")
        if member is None:
            raise ImageError(f"{archive}: no manifest.json (not a docker-archive)")
        manifest = json.load(member)
    return [normalize(tag) for entry in manifest for tag in entry.get("RepoTags") or []]


def normalize(ref: str) -> str:
    """A reference as containerd names it: the docker.io/ (and library/) Docker leaves implicit."""
    first, _, rest = ref.partition("/")
    if not rest:
        return f"docker.io/library/{ref}"
    if "." in first or ":" in first or first == "localhost":
        return ref
    return f"docker.io/{ref}"


def _ctr(address: str, namespace: str, *args: str, timeout: float = 120) -> str:
    """Run ctr against one containerd; its stdout, or ImageError."""
    proc = subprocess.run(["ctr", "--address", address, "--namespace", namespace, *args],
                          capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise ImageError(f"ctr {' '.join(args)} exited {proc.returncode}: {proc.stderr.strip()}")
    return proc.stdout


def imported_keys(address: str, namespace: str = NAMESPACE) -> dict[str, str]:
    """Reference -> input key ('' when unlabelled) of each image in the namespace."""
    refs = _ctr(address, namespace, "images", "ls", "-q").split()
    keys = dict.fromkeys(refs, "")
    for line in _ctr(address, namespace, "images", "ls").splitlines()[1:]:
        fields = line.split()
        if fields and fields[0] in keys:  # REF ... LABELS: the first and the last column have no blanks
            labels = dict(item.split("=", 1) for item in fields[-1].split(",") if "=" in item)
            keys[fields[0]] = labels.get(KEY_LABEL, "")
    return keys


def import_images(ctr_address: str, archives: Iterable[Path], namespace: str = NAMESPACE,
                  timeout: float = IMPORT_TIMEOUT_S) -> dict[Path, float]:
    """Import docker-archives into containerd (unpacked for its default snapshotter) and label them with
    their input key; an archive whose images are there with that key already is skipped (0 s).
    Returns the seconds each import took."""
    present = imported_keys(ctr_address, namespace)
    seconds: dict[Path, float] = {}
    for archive in archives:
        refs, key = archive_refs(archive), archive_key(archive)
        if refs and all(present.get(ref) == key for ref in refs):
            seconds[archive] = 0.0
            continue
        start = time.monotonic()
        _ctr(ctr_address, namespace, "images", "import", str(archive), timeout=timeout)
        for ref in refs:
            _ctr(ctr_address, namespace, "images", "label", ref, f"{KEY_LABEL}={key}")
        seconds[archive] = time.monotonic() - start
    return seconds
