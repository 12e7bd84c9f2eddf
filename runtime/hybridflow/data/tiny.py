"""The built-in tiny model and task: a real HF causal LM small enough to learn on two CPU cores.

Task: the prompt is three digits; the response should repeat the last one (the answer) four times.
A random policy over the 14-token vocabulary scores about 1/14.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path

TINY_MODEL = "builtin:tiny"
TINY_TASK = "builtin:tiny_task"
DIGITS = [str(d) for d in range(10)]
SPECIAL = ["<pad>", "<s>", "</s>", "<unk>"]
VOCAB = SPECIAL + DIGITS
PROMPT_DIGITS = 3
SCORED_TOKENS = 4

TINY_CONFIG = {
    "model_type": "llama",
    "vocab_size": len(VOCAB),
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}


def cache_root() -> Path:
    return Path(os.environ.get("HYBRIDFLOW_CACHE", Path.home() / ".cache" / "hybridflow"))


def tiny_task_answer(prompt: str) -> str:
    """answer = the last digit of the prompt."""
    digits = [t for t in prompt.split() if t.isdigit()]
    return digits[-1]


def tiny_task_reward(prompt: str, response: str, answer: str | None = None) -> float:
    """Share of the first SCORED_TOKENS response tokens equal to the answer: r = #{t_i == a} / 4."""
    target = answer if answer is not None else tiny_task_answer(prompt)
    tokens = response.split()[:SCORED_TOKENS]
    return sum(t == target for t in tokens) / SCORED_TOKENS


def tiny_task_rows(n: int, seed: int = 0, stream: str = "train") -> list[dict[str, str]]:
    """n prompts of PROMPT_DIGITS random digits; each stream (train, val) draws its own."""
    rng = random.Random(seed if stream == "train" else f"{stream}:{seed}")
    rows = []
    for _ in range(n):
        digits = [rng.choice(DIGITS) for _ in range(PROMPT_DIGITS)]
        prompt = " ".join(digits)
        rows.append({"prompt": prompt, "answer": tiny_task_answer(prompt)})
    return rows


def _tokenizer():  # -> PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        padding_side="left",
    )


def ensure_tiny_model(seed: int = 0, **sizes: int) -> Path:
    """Create (once) and return a directory holding the tiny model and tokenizer in HF format; `sizes` replace
    entries of TINY_CONFIG (hidden_size=256, num_hidden_layers=4: a larger model for the same task).

    Loading it goes through from_pretrained like any real model directory.
    """
    unknown = sorted(set(sizes) - set(TINY_CONFIG))
    if unknown:
        raise ValueError(f"not sizes of the tiny model: {', '.join(unknown)}; allowed: {', '.join(TINY_CONFIG)}")
    config = TINY_CONFIG | sizes
    key = hashlib.sha256(json.dumps([config, VOCAB, seed], sort_keys=True).encode()).hexdigest()[:12]
    path = cache_root() / "models" / f"tiny-{key}"
    if (path / "config.json").is_file() and (path / "tokenizer.json").is_file():
        return path
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    cfg = AutoConfig.for_model(str(config.pop("model_type")), **config)
    cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id = 0, 1, 2
    # The caller's random state stays as it was: a process that creates the model (a fresh pod) must go on to
    # sample exactly like one that found it cached.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(tmp)
    _tokenizer().save_pretrained(tmp)
    try:
        tmp.rename(path)
    except OSError:  # another process created it first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return path

