"""The Argo CD health check (charts/hybridflow/health/rltrainingjob.lua), run by a real Lua interpreter.

Argo CD runs health scripts in gopher-lua, a Lua 5.1 implementation, with the live object as the
global `obj`; the script returns {status, message}. lupa embeds the reference Lua 5.1 (and 5.4, to
catch reliance on version quirks), so these tests run the shipped file exactly as it is.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest

lupa = pytest.importorskip("lupa", reason="pip install lupa (a dev dependency) to run the Lua health check")

SCRIPT = Path(__file__).resolve().parents[1] / "charts" / "hybridflow" / "health" / "rltrainingjob.lua"
LUA_VERSIONS = ["lua51", "lua54"]
ARGO_STATUSES = {"Healthy", "Progressing", "Degraded", "Suspended", "Missing", "Unknown"}


def lua_runtime(version: str) -> Any:
    try:
        module = importlib.import_module(f"lupa.{version}")
    except ImportError:
        pytest.skip(f"this lupa build has no {version}")
    return module.LuaRuntime(unpack_returned_tuples=True)


def health(obj: dict[str, Any], version: str = "lua51") -> dict[str, str]:
    """Evaluate the script the way Argo CD does: `obj` as a global table, one returned table."""
    lua = lua_runtime(version)
    lua.globals().obj = lua.table_from(obj, recursive=True)
    result = lua.execute(SCRIPT.read_text())
    return {"status": result["status"], "message": result["message"]}


def cond(kind: str, status: str = "True", reason: str | None = None, message: str = "") -> dict[str, Any]:
    return {
        "type": kind,
        "status": status,
        "reason": reason or kind,
        "message": message,
        "lastTransitionTime": "2025-01-01T00:00:00Z",
    }


def job(*conditions: dict[str, Any], generation: int = 1, observed: int | None = 1, **status: Any) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "hybridflow.io/v1alpha1",
        "kind": "RLTrainingJob",
        "metadata": {"name": "j", "namespace": "default", "generation": generation},
        "spec": {},
        "status": {"conditions": list(conditions), **status},
    }
    if observed is not None:
        obj["status"]["observedGeneration"] = observed
    return obj


RUNNING_PROGRESS = {"step": 120, "totalSteps": 500, "rewardMean": 0.4321}

# (id, object, expected status, fragment of the expected message)
FIXTURES: list[tuple[str, dict[str, Any], str, str]] = [
    (
        "no-status-yet",
        {"apiVersion": "hybridflow.io/v1alpha1", "kind": "RLTrainingJob", "metadata": {"name": "j", "generation": 1}},
        "Progressing",
        "Waiting for the operator to observe the job",
    ),
    ("empty-status", job(observed=None), "Progressing", "Waiting for the operator to report conditions"),
    (
        "generation-lag",
        job(cond("Ready"), generation=3, observed=2),
        "Progressing",
        "observe generation 3",
    ),
    (
        "reconciling",
        job(cond("Reconciling", reason="CreatingRayJob", message="creating RayJob j"), cond("Ready", "False")),
        "Progressing",
        "CreatingRayJob: creating RayJob j",
    ),
    (
        "ready-false-starting",
        job(cond("Ready", "False", reason="RayClusterPending", message="waiting for 2 GPU workers")),
        "Progressing",
        "RayClusterPending: waiting for 2 GPU workers",
    ),
    (
        "running-is-progressing-not-healthy",
        job(cond("Ready", reason="Training", message="training"), progress=RUNNING_PROGRESS),
        "Progressing",
        "Training: training (step 120/500, reward 0.4321)",
    ),
    (
        "running-without-total",
        job(cond("Ready", reason="Training"), progress={"step": 7}),
        "Progressing",
        "Training (step 7)",
    ),
    (
        "succeeded",
        job(
            cond("Succeeded", reason="Completed", message="500 steps"),
            cond("Ready", "False", reason="Completed"),
            progress={"step": 500, "totalSteps": 500},
        ),
        "Healthy",
        "Completed: 500 steps (step 500/500)",
    ),
    (
        "succeeded-then-edited",
        job(cond("Succeeded", reason="Completed"), generation=2, observed=1),
        "Healthy",
        "Completed",
    ),
    (
        "failed",
        job(
            cond("Failed", reason="BackoffLimitExceeded", message="RayJob failed 2 times"),
            cond("Ready", "False"),
            cond("Succeeded", "False"),
        ),
        "Degraded",
        "BackoffLimitExceeded: RayJob failed 2 times",
    ),
    (
        "failed-wins-over-generation-lag",
        job(cond("Failed", reason="DeadlineExceeded"), generation=5, observed=4),
        "Degraded",
        "DeadlineExceeded",
    ),
    (
        "stalled",
        job(
            cond("Stalled", reason="UnknownGPUType", message="no nodes map to gpuType B300"),
            cond("Ready", "False"),
        ),
        "Degraded",
        "UnknownGPUType: no nodes map to gpuType B300",
    ),
    (
        "stalled-beats-reconciling",
        job(cond("Stalled", reason="InvalidSpec"), cond("Reconciling", reason="Retrying")),
        "Degraded",
        "InvalidSpec",
    ),
    (
        "stalled-but-edited",
        job(cond("Stalled", reason="InvalidSpec"), generation=2, observed=1),
        "Progressing",
        "observe generation 2",
    ),
    (
        "suspended",
        job(cond("Suspended", reason="Suspended", message="spec.runPolicy.suspend is true"), cond("Ready", "False")),
        "Suspended",
        "Suspended: spec.runPolicy.suspend is true",
    ),
    (
        "resumed-not-yet-observed",
        job(cond("Suspended", reason="Suspended"), generation=2, observed=1),
        "Progressing",
        "observe generation 2",
    ),
    (
        "false-outcomes-are-not-outcomes",
        job(cond("Failed", "False"), cond("Succeeded", "False"), cond("Stalled", "False"), cond("Ready")),
        "Progressing",
        "Ready",
    ),
    (
        "being-deleted",
        {**job(cond("Ready")), "metadata": {"name": "j", "generation": 1, "deletionTimestamp": "2025-01-01T00:00:00Z"}},
        "Progressing",
        "Being deleted",
    ),
    (
        "condition-without-reason-or-message",
        job({"type": "Stalled", "status": "True"}),
        "Degraded",
        "Stalled",
    ),
]


@pytest.mark.parametrize("version", LUA_VERSIONS)
@pytest.mark.parametrize(("case", "obj", "status", "message"), FIXTURES, ids=[f[0] for f in FIXTURES])
def test_health(case: str, obj: dict[str, Any], status: str, message: str, version: str) -> None:
    result = health(obj, version)
    assert result["status"] == status, f"{case}: {result}"
    assert message in result["message"], f"{case}: {result}"


@pytest.mark.parametrize(("case", "obj", "status", "message"), FIXTURES, ids=[f[0] for f in FIXTURES])
def test_every_answer_is_an_argo_status_with_a_message(
    case: str, obj: dict[str, Any], status: str, message: str
) -> None:
    result = health(obj)
    assert result["status"] in ARGO_STATUSES
    assert isinstance(result["message"], str) and result["message"]


def test_status_model_conditions_are_all_handled() -> None:
    """Every condition type the operator may write is one the script knows about."""
    from hybridflow.api.status import CONDITION_TYPES

    text = SCRIPT.read_text()
    for kind in CONDITION_TYPES:
        assert f'"{kind}"' in text, f"the health check ignores the {kind} condition"


def test_script_uses_only_what_argo_cd_provides() -> None:
    """Argo CD's sandbox has no io/os/require; a script using them fails only in production."""
    text = SCRIPT.read_text()
    for forbidden in ("require(", "io.", "os.", "dofile", "loadfile", "goto "):
        assert forbidden not in text, forbidden
