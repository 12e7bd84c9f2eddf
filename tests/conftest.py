"""Shared fixtures for the runtime tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


@pytest.fixture
def example_doc():
    """A fresh dict of an example job, to edit in a test."""

    def load(name: str) -> dict:
        return yaml.safe_load((EXAMPLES / name).read_text())

    return load
