"""Dependencies point one way: the operator imports hybridflow, the runtime never imports the operator."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNTIME = ROOT / "runtime" / "hybridflow"


def imported_modules(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
    return found


def test_no_runtime_module_imports_the_operator() -> None:
    offenders = {str(p.relative_to(ROOT)): sorted(m for m in imported_modules(p) if m.split(".")[0] in
                                                 ("hybridflow_operator", "kopf"))
                 for p in RUNTIME.rglob("*.py")}
    assert not {p: m for p, m in offenders.items() if m}


def test_rendering_and_the_render_command_load_neither_the_operator_nor_kopf() -> None:
    code = (
        "import sys, pkgutil, importlib, hybridflow.k8s\n"
        "for m in pkgutil.iter_modules(hybridflow.k8s.__path__): importlib.import_module(f'hybridflow.k8s.{m.name}')\n"
        "import hybridflow.cli\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('hybridflow_operator', 'kopf')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
