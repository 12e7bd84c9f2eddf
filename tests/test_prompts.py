"""Prompt sources and formats: chat prompts through a real tokenizer's chat template, raw text as before,
and spec.data.train / spec.data.val problems named by field. No Ray: the worker runs in this process."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from hybridflow.api import parse_job
from hybridflow.data import DataError
from hybridflow.data.chat import CHAT, FORMAT_KEY
from hybridflow.data.prompts import TINY_VAL_SIZE, load_prompts, load_rows
from hybridflow.data.tiny import ensure_tiny_model
from hybridflow.preflight import preflight
from hybridflow.workers.host import WorkerHost
from hybridflow.workers.rollout import encode_prompts

# A chat template in the tiny model's vocabulary (digits and <s> </s>): each turn is a role digit (system 7,
# user 8, assistant 9), its content and </s>; the generation prompt opens an assistant turn.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %} {{ {'system': '7', 'user': '8', 'assistant': '9'}[m['role']] }} "
    "{{ m['content'] }} {{ eos_token }}{% endfor %}{% if add_generation_prompt %} 9{% endif %}"
)
MESSAGES = [{"role": "system", "content": "1"}, {"role": "user", "content": "2 3 4"}]
RENDERED = "<s> 7 1 </s> 8 2 3 4 </s> 9"
# <pad>=0 <s>=1 </s>=2 <unk>=3, digit d = 4 + d
RENDERED_IDS = [1, 11, 5, 2, 12, 6, 7, 8, 2, 13]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in tiny model, its tokenizer given TEMPLATE as chat_template (saved like any HF model)."""
    path = tmp_path_factory.mktemp("chat") / "model"
    shutil.copytree(ensure_tiny_model(), path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return path


@pytest.fixture
def prompts_file(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    rows = [{"prompt": MESSAGES, "answer": "4"}, {"prompt": "5 6", "answer": "6"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def spec_of(example_doc, policy: str, train: str, prompt_format: str | None = None, **data):
    doc = example_doc("tiny-grpo.yaml")
    doc["spec"]["model"]["policy"]["path"] = policy
    doc["spec"]["data"].update(train=train, maxPromptLength=16, **data)
    if prompt_format is not None:
        doc["spec"]["data"]["promptFormat"] = prompt_format
    return parse_job(doc).spec


def test_the_fixture_template_is_real(chat_model: Path) -> None:
    tok = AutoTokenizer.from_pretrained(chat_model)
    assert tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False) == RENDERED
    assert list(tok.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"]) == RENDERED_IDS


def test_auto_renders_message_lists_with_the_chat_template_and_keeps_strings(
        example_doc, chat_model: Path, prompts_file: Path) -> None:
    spec = spec_of(example_doc, str(chat_model), str(prompts_file))
    assert spec.data.prompt_format == "auto"
    assert load_prompts(spec, "train") == [
        {"prompt": RENDERED, FORMAT_KEY: CHAT, "answer": "4"},
        {"prompt": "5 6", "answer": "6"},
    ]


def test_a_rendered_prompt_is_tokenized_as_the_template_tokenizes_it(
        example_doc, chat_model: Path, prompts_file: Path) -> None:
    """No second BOS on the templated prompt; the plain one gets the tokenizer's BOS as before; left padding."""
    spec = spec_of(example_doc, str(chat_model), str(prompts_file))
    rows = load_prompts(spec, "train")
    tok = AutoTokenizer.from_pretrained(chat_model)
    ids, mask = encode_prompts(tok, rows, 16)
    assert ids.tolist() == [RENDERED_IDS, [0] * 7 + [1, 9, 10]]
    assert mask.tolist() == [[1] * 10, [0] * 7 + [1] * 3]


def test_the_worker_generates_from_the_templated_ids(example_doc, chat_model: Path, prompts_file: Path) -> None:
    spec = spec_of(example_doc, str(chat_model), str(prompts_file))
    rows = load_prompts(spec, "train")
    host = WorkerHost(spec.model_dump(mode="json"), {"actor_rollout": "actor_rollout", "reward_score": "reward"},
                      instance=0, use_gpu=False)
    batch = host.rollout(rows, [0, 1], ["reward"])
    assert batch.prompt_length == len(RENDERED_IDS)
    assert batch.input_ids[0, :batch.prompt_length].tolist() == RENDERED_IDS
    assert batch.prompts[0] == RENDERED
    assert batch.input_ids.shape == (2, len(RENDERED_IDS) + spec.data.max_response_length)
    assert batch.tensors["scores"].shape == (2,)


def test_chat_wraps_strings_as_one_user_message(example_doc, chat_model: Path) -> None:
    spec = spec_of(example_doc, str(chat_model), "builtin:tiny_task", "chat")
    first = load_prompts(spec, "train")[0]
    assert first == {"prompt": f"<s> 8 {load_rows('builtin:tiny_task', 'prompt', 'answer')[0]['prompt']} </s> 9",
                     FORMAT_KEY: CHAT, "answer": first["answer"]}


def test_raw_never_uses_the_template(example_doc, chat_model: Path, prompts_file: Path) -> None:
    """The messages' contents joined by newlines, tokenized with the tokenizer's BOS: as before promptFormat."""
    spec = spec_of(example_doc, str(chat_model), str(prompts_file), "raw")
    rows = load_prompts(spec, "train")
    assert rows == [{"prompt": "1\n2 3 4", "answer": "4"}, {"prompt": "5 6", "answer": "6"}]
    assert rows == load_rows(str(prompts_file), "prompt", "answer")
    ids, _ = encode_prompts(AutoTokenizer.from_pretrained(chat_model), rows, 16)
    assert ids.tolist() == [[1, 5, 6, 7, 8], [0, 0, 1, 9, 10]]


def test_plain_prompts_encode_exactly_as_the_tokenizer_pads_them() -> None:
    """The default job's prompts, each repeated as a group of samples repeats it: the same ids and mask as one
    padded tokenizer call (the encoding before)."""
    tok = AutoTokenizer.from_pretrained(ensure_tiny_model())
    tok.padding_side = "left"
    rows = [{"prompt": p} for p in ("1 2 3", "4", "5 6 7 8 9 0 1 2 3") for _ in range(3)]
    ids, mask = encode_prompts(tok, rows, 8)
    enc = tok([r["prompt"] for r in rows], return_tensors="pt", padding=True, truncation=True, max_length=8)
    assert torch.equal(ids, enc["input_ids"]) and torch.equal(mask, enc["attention_mask"])


@pytest.mark.parametrize("prompt_format", ["chat", "auto"])
def test_chat_prompts_without_a_template_name_prompt_format(example_doc, prompts_file: Path,
                                                            prompt_format: str) -> None:
    spec = spec_of(example_doc, "builtin:tiny", str(prompts_file), prompt_format)
    with pytest.raises(DataError, match=r"^spec\.data\.promptFormat: chat prompts need a chat template, and the "
                                        r"tokenizer of spec\.model\.policy\.path \(builtin:tiny\) has none; use "
                                        r"promptFormat raw"):
        load_prompts(spec, "train")
    assert any(p.startswith("spec.data.promptFormat: ") for p in preflight(spec))


def test_the_default_job_needs_no_template(example_doc) -> None:
    spec = parse_job(example_doc("tiny-ppo.yaml")).spec
    assert spec.data.prompt_format == "auto" and spec.data.val is None
    rows = load_prompts(spec, "train")
    assert rows == load_rows("builtin:tiny_task", "prompt", "answer") and FORMAT_KEY not in rows[0]
    assert load_prompts(spec, "val") == []


def test_the_built_in_val_set_is_a_draw_of_its_own(example_doc) -> None:
    spec = spec_of(example_doc, "builtin:tiny", "builtin:tiny_task", val="builtin:tiny_task")
    val, train = load_prompts(spec, "val"), load_prompts(spec, "train")
    assert len(val) == TINY_VAL_SIZE and val == load_prompts(spec, "val")
    assert val != train[:TINY_VAL_SIZE]
    assert all(r["answer"] == r["prompt"].split()[-1] for r in val)


@pytest.mark.parametrize(("val", "problem"), [
    ("{tmp}/missing.jsonl", "spec.data.val: file not found: {tmp}/missing.jsonl"),
    ("builtin:gsm8k", "spec.data.val: unknown built-in dataset 'builtin:gsm8k', allowed: builtin:tiny_task"),
    ("{tmp}/val.csv", "spec.data.val: unsupported file type '.csv', allowed: .parquet, .jsonl, hf://datasets/..."),
    ("{tmp}/empty.jsonl", "spec.data.val: {tmp}/empty.jsonl has no rows"),
    ("{tmp}/broken.jsonl", "spec.data.val: {tmp}/broken.jsonl is not JSON lines: line 2: Expecting value"),
])
def test_val_problems_name_the_field(example_doc, tmp_path: Path, val: str, problem: str) -> None:
    (tmp_path / "val.csv").write_text("prompt\n1 2 3\n")
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "broken.jsonl").write_text('{"prompt": "1 2 3"}\n{"prompt": \n')
    spec = spec_of(example_doc, "builtin:tiny", "builtin:tiny_task", val=val.format(tmp=tmp_path))
    assert preflight(spec) == [problem.format(tmp=tmp_path)]


@pytest.fixture
def long_prompts(tmp_path: Path) -> Path:
    """Prompts of 4, 12 and 9 tokens with the tiny tokenizer's BOS (digit d is token 4 + d)."""
    path = tmp_path / "long.jsonl"
    rows = [{"prompt": "1 2 3", "answer": "3"}, {"prompt": " ".join("0123456789 1"), "answer": "1"},
            {"prompt": "9 8 7 6 5 4 3 2", "answer": "2"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def long_spec(example_doc, train: Path, **data):
    doc = example_doc("tiny-grpo.yaml")
    doc["spec"]["data"].update({"train": str(train), "val": None, "maxPromptLength": 8} | data)
    doc["spec"]["trainer"]["evalEvery"] = 0
    return parse_job(doc).spec


def test_prompts_over_the_limit_stop_the_job_before_it_starts(example_doc, long_prompts: Path) -> None:
    spec = long_spec(example_doc, long_prompts)
    message = ("spec.data.maxPromptLength: 2 of the 3 prompts of spec.data.train are longer than 8 tokens (the "
               "longest, row 1, has 12); raise maxPromptLength, set data.filterOverlongPrompts to drop them, or "
               "data.truncation left, right or middle to cut them")
    with pytest.raises(DataError) as e:
        load_prompts(spec, "train")
    assert str(e.value) == message
    assert message in preflight(spec)


def test_filter_overlong_prompts_drops_them_as_the_dataset_loads(example_doc, long_prompts: Path) -> None:
    spec = long_spec(example_doc, long_prompts, filterOverlongPrompts=True)
    assert [r["prompt"] for r in load_prompts(spec, "train")] == ["1 2 3"]
    with pytest.raises(DataError, match=r"every prompt of spec\.data\.train is longer than 3 tokens"):
        load_prompts(long_spec(example_doc, long_prompts, filterOverlongPrompts=True, maxPromptLength=3), "train")


@pytest.mark.parametrize("side", ["left", "right", "middle"])
def test_truncation_keeps_the_end_the_start_or_both_of_a_long_prompt(example_doc, long_prompts: Path,
                                                                     side: str) -> None:
    spec = long_spec(example_doc, long_prompts, truncation=side)
    rows = load_prompts(spec, "train")
    assert len(rows) == 3
    host = WorkerHost(spec.model_dump(mode="json"), {"actor_rollout": "actor_rollout"}, instance=0, use_gpu=False)
    batch = host.rollout(rows[1:2], [0], [])
    digits = [4 + int(d) for d in "0123456789"] + [5]
    kept = {"left": [1, *digits[-7:]], "right": [1, *digits[:7]],  # the tokenizer keeps its BOS
            "middle": [1, *digits[:3], *digits[-4:]]}[side]  # the first 8 // 2 ids, BOS among them, and the last 4
    assert batch.input_ids[0, :batch.prompt_length].tolist() == kept


VERL_ROWS = [  # the shape of verl's prepared datasets: the ground truth inside reward_model
    {"data_source": "tiny", "prompt": [{"role": "user", "content": "1 2 3"}],
     "reward_model": {"style": "rule", "ground_truth": "3"}, "extra_info": {"index": 0}},
    {"data_source": "tiny", "prompt": [{"role": "user", "content": "4 0"}],
     "reward_model": {"style": "rule", "ground_truth": 0}, "extra_info": {"index": 1}},
    {"data_source": "tiny", "prompt": [{"role": "user", "content": "5"}], "reward_model": {"style": "rule"},
     "extra_info": {"index": 2}},
]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_a_dotted_answer_key_reads_verls_nested_ground_truth(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"train{suffix}"
    if suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist([{**r, "reward_model": {"style": "rule", "ground_truth": None}
                                              | {k: str(v) for k, v in r["reward_model"].items()}}
                                             for r in VERL_ROWS]), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in VERL_ROWS))
    rows = load_rows(str(path), "prompt", "reward_model.ground_truth")
    assert [r["answer"] for r in rows] == ["3", "0", ""]  # a 0 is an answer; a row without one passes ""
    assert [r["prompt"] for r in rows] == ["1 2 3", "4 0", "5"]


def test_an_answer_key_no_row_holds_names_the_field(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in VERL_ROWS))
    with pytest.raises(DataError, match=r"^spec\.data\.answerKey: no row of .* has 'reward_model\.truth' \(columns: "
                                        r"\['data_source', 'extra_info', 'prompt', 'reward_model'\]"):
        load_rows(str(path), "prompt", "reward_model.truth")
    assert {r["answer"] for r in load_rows(str(path), "prompt", "answer")} == {""}  # the default may be absent
