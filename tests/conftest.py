"""Shared fixtures for the runtime tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.graph_rules import RULES
from tests.helpers import minimal_apiserver

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


@pytest.fixture
def example_doc():
    """A fresh dict of an example job, to edit in a test."""

    def load(name: str) -> dict:
        return yaml.safe_load((EXAMPLES / name).read_text())

    return load


@pytest.fixture(params=sorted(RULES))
def broken(request, example_doc) -> tuple[dict, str]:
    """A tiny-ppo job breaking one training rule, and the message that must name it (tests/graph_rules.py)."""
    change, needle = RULES[request.param]
    doc = example_doc("tiny-ppo.yaml")
    change(doc)
    return doc, needle


@pytest.fixture
def float64_by_default() -> Iterator[None]:
    """Exact comparisons against hand arithmetic; the default dtype is restored for the other modules."""
    import torch

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


@pytest.fixture(scope="module")
def apiserver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """etcd + kube-apiserver with only the RLTrainingJob CRD installed (generated now, not read from disk)."""
    from hybridflow.api import crd as crdgen

    crd_dir = tmp_path_factory.mktemp("crd")
    (crd_dir / crdgen.CRD_FILE).write_text(crdgen.render_crd_yaml())
    with minimal_apiserver(tmp_path_factory, [crd_dir / crdgen.CRD_FILE]) as cp:
        yield cp
