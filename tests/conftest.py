"""Shared fixtures for the runtime tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.graph_rules import RULES

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
