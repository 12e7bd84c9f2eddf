"""The security checks of the campaign: the tests that prove the security promises, run and counted."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
FILES = (
    "tests/test_security.py",  # the job's Role, capabilities, Secrets in rendered objects, NetworkPolicy
    "tests/test_no_pickles.py",  # no code path unpickles a file
    "e2e/test_security_controlplane.py",  # a real token of the job's ServiceAccount against a real API server
)


def count(junit: Path) -> dict[str, int]:
    """passed/failed/skipped of a JUnit XML report; an error counts as failed."""
    tests = failed = skipped = 0
    for suite in ET.parse(junit).getroot().iter("testsuite"):
        tests += int(suite.get("tests", 0))
        failed += int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        skipped += int(suite.get("skipped", 0))
    return {"passed": tests - failed - skipped, "failed": failed, "skipped": skipped}


def run() -> dict[str, Any]:
    """Run the security tests under CI=true (nothing may skip) and count them."""
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "security.xml"
        env = {**os.environ, "CI": "true"}
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
                        *FILES], cwd=ROOT, env=env, check=False)
        counts = count(junit) if junit.is_file() else {"passed": 0, "failed": 1, "skipped": 0}
    return {**counts, "files": list(FILES)}
