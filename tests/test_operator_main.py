"""`python -m hybridflow_operator`: its command line and process set-up, in fresh interpreters."""

from __future__ import annotations

import subprocess
import sys


def python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_tune_gc_freezes_what_the_imports_made_and_widens_the_young_generation() -> None:
    done = python(
        "import gc\n"
        "from hybridflow_operator.__main__ import YOUNG_GENERATION, tune_gc\n"
        "import hybridflow_operator.lifecycle\n"
        "before = gc.get_threshold()\n"
        "tune_gc()\n"
        "after = gc.get_threshold()\n"
        "print(gc.get_freeze_count(), len(gc.get_objects()), after[0] == YOUNG_GENERATION, after[1:] == before[1:])\n"
    )
    assert done.returncode == 0, done.stderr
    frozen, tracked, young, older_unchanged = done.stdout.split()
    assert int(frozen) > 10 * int(tracked)  # the modules' objects are out of every collection's way
    assert young == older_unchanged == "True"


def test_a_bad_setting_is_one_line_naming_it_and_exit_2() -> None:
    done = subprocess.run([sys.executable, "-m", "hybridflow_operator", "--status-interval", "soon"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert "HYBRIDFLOW_STATUS_INTERVAL" in done.stderr and done.stderr.startswith("hybridflow-operator: ")
