"""e2e/harness/images.py against a real containerd: a throwaway one (its own root, state and socket under
the test's temporary directory, no CRI plugin), fed the pause image, the smallest that
docker/build-images.sh makes. Needs root, buildah, containerd and ctr; skipped without them."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e.harness import images

TOOLS = ("buildah", "containerd", "ctr", "debootstrap")
pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not all(shutil.which(t) for t in TOOLS),
    reason=f"needs root and {', '.join(TOOLS)} (e2e/toolchain/install-node-packages.sh)",
)
START_S = 30.0


def containerd_config(root: Path) -> str:
    """Everything under `root`; the CRI plugin off, as nothing here runs pods."""
    return (f'version = 2\nroot = "{root}/root"\nstate = "{root}/state"\n'
            'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n'
            f'[grpc]\n  address = "{root}/containerd.sock"\n'
            f'[ttrpc]\n  address = "{root}/containerd.sock.ttrpc"\n'
            f'[plugins."io.containerd.internal.v1.opt"]\n  path = "{root}/opt"\n')


@pytest.fixture
def containerd(tmp_path: Path) -> Iterator[str]:
    """The socket of a containerd started for this test, stopped after it."""
    config = tmp_path / "config.toml"
    config.write_text(containerd_config(tmp_path))
    with (tmp_path / "containerd.log").open("wb") as log:
        proc = subprocess.Popen(["containerd", "--config", str(config)], stdout=log, stderr=subprocess.STDOUT)
    socket = tmp_path / "containerd.sock"
    try:
        deadline = time.monotonic() + START_S
        while not socket.exists():
            assert proc.poll() is None, (tmp_path / "containerd.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "containerd did not open its socket"
            time.sleep(0.1)
        yield str(socket)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_import_labels_and_skips_what_is_there(containerd: str) -> None:
    archive = images.build_images([images.PAUSE])[images.PAUSE]
    ref = images.image_refs()[images.PAUSE]
    assert images.archive_refs(archive) == [ref]

    first = images.import_images(containerd, [archive])
    assert first[archive] > 0
    assert images.imported_keys(containerd)[ref] == images.archive_key(archive)
    assert images.import_images(containerd, [archive]) == {archive: 0.0}
