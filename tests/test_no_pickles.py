"""No untrusted pickles: checkpoints and data files are read without running code stored in them.

A checkpoint directory or a data file may sit on shared storage others can write; `pickle.load` (and
`torch.load(weights_only=False)`, `numpy.load(allow_pickle=True)`, `pandas.read_pickle`, ...) would run
whatever a planted file holds. The scan below fails on any such call in the code that runs in the
operator and the Ray pods; the checkpoint tests show the files the runtime writes load with
`weights_only=True`. (Ray's own object transfer uses cloudpickle between the job's processes: that is
Ray's machinery, not a file we read.)
"""

from __future__ import annotations

import ast
import json
import random
from pathlib import Path

import pytest
import torch

from hybridflow import algos, checkpoint
from hybridflow.api import parse_job
from hybridflow.data.prompts import PromptSampler, load_rows

ROOT = Path(__file__).resolve().parents[1]
SCANNED = (ROOT / "runtime", ROOT / "operator")

UNPICKLERS = {
    "pickle.load", "pickle.loads", "pickle.Unpickler", "_pickle.load", "_pickle.loads", "_pickle.Unpickler",
    "cPickle.load", "cPickle.loads", "cloudpickle.load", "cloudpickle.loads", "dill.load", "dill.loads",
    "joblib.load", "shelve.open", "marshal.load", "marshal.loads", "pandas.read_pickle", "yaml.unsafe_load",
    "yaml.full_load", "torch.serialization._load",
}
"""Calls that unpickle (or build arbitrary objects) whatever they are given: never in our code."""


def _aliases(tree: ast.Module) -> dict[str, str]:
    """Local name -> the module or function it stands for (`import numpy as np`: np -> numpy)."""
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    out[alias.asname] = alias.name
                else:
                    top = alias.name.split(".")[0]
                    out[top] = top
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                out[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return out


def _dotted(node: ast.expr, aliases: dict[str, str]) -> str | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(aliases.get(node.id, node.id))
    return ".".join(reversed(parts))


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_constant(node: ast.expr | None, value: object) -> bool:
    return isinstance(node, ast.Constant) and node.value is value


def pickle_loads(source: str, filename: str = "<source>") -> list[str]:
    """Every call in `source` that may unpickle what it reads, as `file:line: call (why)`."""
    tree = ast.parse(source, filename)
    aliases = _aliases(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func, aliases)
        if name is None:
            continue
        why = None
        if name in UNPICKLERS or name.endswith(".read_pickle") or name == "read_pickle":
            why = "unpickles"
        elif name == "torch.load" and not _is_constant(_keyword(node, "weights_only"), True):
            why = "torch.load without weights_only=True"
        elif name in ("numpy.load", "numpy.lib.npyio.load") and not (
                _keyword(node, "allow_pickle") is None or _is_constant(_keyword(node, "allow_pickle"), False)):
            why = "numpy.load with allow_pickle"
        elif name == "yaml.load" and not any(
                (_dotted(k.value, aliases) or "").endswith(("SafeLoader", "CSafeLoader", "BaseLoader"))
                for k in node.keywords if k.arg == "Loader"):
            why = "yaml.load without a safe Loader"
        if why:
            found.append(f"{filename}:{node.lineno}: {name} ({why})")
    return found


def test_no_code_path_unpickles_a_file() -> None:
    files = sorted(p for root in SCANNED for p in root.rglob("*.py"))
    assert len(files) > 50, "the scan found too few files: is the layout still runtime/ and operator/?"
    found = [hit for p in files for hit in pickle_loads(p.read_text(), str(p.relative_to(ROOT)))]
    assert not found, ("these calls may run code stored in a checkpoint or data file; load tensors with "
                       "torch.load(..., weights_only=True) (hybridflow.checkpoint.load_state) or safetensors, "
                       "data with a format that holds no code:\n" + "\n".join(found))


@pytest.mark.parametrize("snippet", [
    "import torch\ntorch.load(p)",
    "import torch\ntorch.load(p, weights_only=False)",
    "from torch import load\nload(p, weights_only=flag)",
    "import pickle\npickle.loads(b)",
    "from pickle import load as l\nl(f)",
    "import cloudpickle\ncloudpickle.loads(b)",
    "import numpy as np\nnp.load(p, allow_pickle=True)",
    "import pandas as pd\npd.read_pickle(p)",
    "df = frame.read_pickle(p)",
    "import yaml\nyaml.load(text)",
    "import yaml\nyaml.load(text, Loader=yaml.Loader)",
    "import joblib\njoblib.load(p)",
])
def test_the_scan_finds_each_kind_of_unpickling(snippet: str) -> None:
    assert pickle_loads(snippet), snippet


@pytest.mark.parametrize("snippet", [
    "import torch\ntorch.load(p, weights_only=True)",
    "import numpy as np\nnp.load(p)\nnp.load(p, allow_pickle=False)",
    "import yaml\nyaml.safe_load(t)\nyaml.load(t, Loader=yaml.SafeLoader)",
    "import json\njson.loads(s)",
])
def test_the_scan_lets_safe_loads_pass(snippet: str) -> None:
    assert pickle_loads(snippet) == []


# -- what the runtime writes loads with weights_only=True -------------------------------------------------


def test_the_controller_checkpoint_loads_with_weights_only(tmp_path: Path) -> None:
    from hybridflow.trainer import CONTROLLER_FILE, controller_state

    sampler = PromptSampler(load_rows("builtin:tiny_task", "prompt", "answer"), 4, seed=3, shuffle=True)
    sampler.next_batch()
    kl = algos.AdaptiveKLController(0.05, 6.0, 10_000)
    kl.update(3.0, 8)
    random.seed(11)
    state = controller_state(7, kl, sampler.state_dict(), ["actor_rollout_0", "critic_0"])
    checkpoint.save_state(state, tmp_path / CONTROLLER_FILE)
    expected_draw = random.random()

    loaded = torch.load(tmp_path / CONTROLLER_FILE, weights_only=True)
    assert loaded["step"] == 7 and loaded["world"] == {"actor_rollout_0": 1, "critic_0": 1}
    assert loaded["kl_ctl"] == kl.state_dict() and loaded["data"] == sampler.state_dict()
    assert torch.equal(loaded["rng"]["torch"], state["rng"]["torch"])
    random.setstate(loaded["rng"]["python"])
    assert random.random() == expected_draw


def test_a_worker_checkpoint_loads_with_weights_only(example_doc, tmp_path: Path) -> None:
    """The rank file (version, shuffle generator, RNG) loads with weights_only; the training state (fp32
    weights, Adam's moments after a step) is DCP with a JSON index, and the only copy of the weights."""
    from hybridflow import dcp
    from hybridflow.workers.host import WorkerHost

    doc = example_doc("tiny-ppo.yaml")
    doc["spec"]["data"]["batchSize"] = 8
    doc["spec"]["algorithm"]["miniBatchSize"] = 8
    spec = parse_job(doc).spec.model_dump(mode="json")
    host = WorkerHost(spec, {"actor_rollout": "actor_rollout", "reward_score": "reward"}, instance=0,
                      use_gpu=False)
    rows = load_rows("builtin:tiny_task", "prompt", "answer")[:8]
    batch = host.rollout(rows, list(range(8)), ["reward", "old_log_probs"])
    batch.tensors["advantages"] = torch.randn_like(batch.tensors["old_log_probs"])
    host.update(batch, 0.0)
    path = host.save(str(tmp_path), "actor_rollout_0")

    loaded = torch.load(path, weights_only=True)
    actor = loaded["roles"]["actor_rollout"]
    assert "model" not in actor and isinstance(actor["shuffle"], torch.Tensor)
    training = checkpoint.training_dir(tmp_path, "actor_rollout_0", "actor_rollout")
    index = json.loads((training / dcp.INDEX_FILE).read_text())
    assert index["tensors"], "the index is JSON"
    weights = dcp.read_full(training, "model.")
    assert weights.keys() == dict(host.workers["actor_rollout"].model.named_parameters()).keys()
    moments = dcp.read_full(training, "optim.")
    assert any(k.endswith(".exp_avg_sq") and v.abs().sum() > 0 for k, v in moments.items()), \
        "the optimizer's moments are part of the checkpoint"
    assert host.load(str(tmp_path), "actor_rollout_0")


def test_a_planted_pickle_index_is_refused_without_running(tmp_path: Path) -> None:
    """DCP's own index is a pickle; ours is JSON, so a pickled index planted in a checkpoint is an error."""
    import pickle

    from hybridflow import dcp

    class Payload:
        def __reduce__(self) -> tuple:
            return (Path.touch, (tmp_path / "ran",))

    dcp.save({"w": torch.arange(4.0)}, tmp_path / "ck")
    (tmp_path / "ck" / dcp.INDEX_FILE).write_bytes(pickle.dumps(Payload()))
    state = {"w": torch.zeros(4)}
    with pytest.raises(dcp.CheckpointFormatError, match="not a JSON checkpoint index"):
        dcp.load(state, tmp_path / "ck")
    assert not (tmp_path / "ran").exists()


def test_only_tensors_go_into_a_sharded_checkpoint(tmp_path: Path) -> None:
    """Non-tensor values would be stored (and read back) by DCP as pickles."""
    from hybridflow import dcp

    with pytest.raises(TypeError, match="only tensors go into a sharded checkpoint; not step"):
        dcp.save({"w": torch.ones(2), "step": 3}, tmp_path / "ck")  # type: ignore[dict-item]
    dcp.save({"w": torch.ones(2)}, tmp_path / "ck")
    assert torch.equal(dcp.read_full(tmp_path / "ck")["w"], torch.ones(2))


def test_a_planted_pickle_is_refused(tmp_path: Path) -> None:
    """What weights_only buys: a file whose unpickling would run code is an error, and the code never runs."""

    class Payload:
        def __reduce__(self) -> tuple:
            return (Path.touch, (tmp_path / "ran",))

    torch.save({"step": 1, "payload": Payload()}, tmp_path / "controller.pt")
    with pytest.raises(Exception, match=r"[Ww]eights only load failed|Unsupported global"):
        checkpoint.load_state(tmp_path / "controller.pt")
    assert not (tmp_path / "ran").exists()
