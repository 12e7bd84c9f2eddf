"""The torch engine's sampling loop: the tokens Hugging Face's `generate` would write, drawn from the same
distribution, with a repeated prompt prefilled once and finished sequences out of the batch, and the log-probs
of what it drew."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hybridflow.data.tiny import ensure_tiny_model
from hybridflow.workers.decoding import Sampling, compacts, next_tokens, nucleus, sample, top_k
from hybridflow.workers.modeling import load_causal_lm, load_tokenizer, response_log_probs
from hybridflow.workers.rollout import assemble_batch, left_pad

NEW = 12


@pytest.fixture(scope="module")
def tiny() -> tuple[Any, Any]:
    path = str(ensure_tiny_model())
    return load_causal_lm(path, "float32", torch.device("cpu")).eval(), load_tokenizer(path)


def prompts(tok: Any, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    return left_pad([tok(t)["input_ids"] for t in texts], tok.pad_token_id)


TEXTS = ["1 2 3", "4 5", "7 0 9 8", "1 2 3", "6", "4 5"]  # the tiny task's digits; repeats, left padding


def test_greedy_responses_are_those_of_hf_generate(tiny: tuple[Any, Any]) -> None:
    model, tok = tiny
    ids, mask = prompts(tok, TEXTS)
    ours, _ = sample(model, ids, mask, NEW, Sampling(0.0), tok.eos_token_id, tok.pad_token_id)
    with torch.no_grad():
        theirs = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[:, ids.shape[1]:]
    theirs = torch.nn.functional.pad(theirs, (0, NEW - theirs.shape[1]), value=tok.pad_token_id)
    assert torch.equal(ours, theirs)


def test_a_repeated_prompt_is_prefilled_once_and_finished_sequences_leave_the_batch(
        tiny: tuple[Any, Any]) -> None:
    model, tok = tiny
    ids, mask = prompts(tok, TEXTS * 3)  # 18 rows: two finished rows make an eighth
    rows: list[int] = []
    hook = model.register_forward_pre_hook(lambda _m, _a, kw: rows.append(kw["input_ids"].shape[0]),
                                           with_kwargs=True)
    try:
        torch.manual_seed(3)
        out, _ = sample(model, ids, mask, NEW, Sampling(1.5), tok.eos_token_id, tok.pad_token_id)
    finally:
        hook.remove()
    assert rows[0] == len(set(TEXTS))  # the prefill
    is_eos = out == tok.eos_token_id
    ended = torch.where(is_eos.any(1), is_eos.int().argmax(1), NEW).tolist()  # where each response wrote EOS
    assert sorted(ended)[1] < NEW - 2, "fewer than two responses ended early: the case is not exercised"
    batch, want = len(ended), []
    for t in range(NEW - 1):  # the rows of the pass that draws token t + 1
        finished = sum(e <= t for e in ended) - (len(ended) - batch)
        if finished == batch:
            break
        if compacts(finished, batch):
            batch -= finished
        want.append(batch)
    assert rows[1:] == want
    assert want[-1] < len(ended)
    for row, end in enumerate(ended):
        assert bool((out[row, end + 1:] == tok.pad_token_id).all())


def test_the_log_probs_of_the_drawn_tokens_are_the_models_own_whatever_the_sampling(tiny: tuple[Any, Any]) -> None:
    """What the trainer's teacher-forced pass gives the same tokens (float32 rounding apart): the raw model's, not
    the tempered nucleus the tokens were drawn from; 0 after each response's end."""
    model, tok = tiny
    ids, mask = prompts(tok, TEXTS * 3)
    torch.manual_seed(5)
    out, log_probs = sample(model, ids, mask, NEW, Sampling(1.5, 0.9, 20), tok.eos_token_id, tok.pad_token_id)
    batch = assemble_batch(ids, mask, out, log_probs, tok.eos_token_id, tok.pad_token_id,
                           [{"prompt": t} for t in TEXTS * 3], [""] * len(out), list(range(len(out))), 0)
    with torch.no_grad():
        forward, _ = response_log_probs(model, batch, torch.device("cpu"))
    engine = batch.tensors["rollout_log_probs"]
    valid = batch.response_mask.bool()
    assert (engine[~valid] == 0).all() and (engine[valid] < 0).all()
    torch.testing.assert_close(engine[valid], forward[valid], rtol=0, atol=1e-4)


def test_finished_rows_leave_once_they_are_an_eighth_of_the_batch() -> None:
    assert [compacts(f, 16) for f in (1, 2)] == [False, True]
    assert [compacts(f, 4) for f in (0, 1)] == [False, True]


def test_the_nucleus_is_the_fewest_most_probable_tokens_that_reach_top_p() -> None:
    logits = torch.tensor([[0.15, 0.05, 0.5, 0.3]]).log()
    kept = [torch.isfinite(nucleus(logits, p))[0].tolist() for p in (0.45, 0.75, 0.9, 1.0)]
    assert kept == [[False, False, True, False], [False, False, True, True], [True, False, True, True],
                    [True, True, True, True]]


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.5, 1.0), (1.0, 0.65)])
def test_drawn_tokens_follow_the_tempered_nucleus(temperature: float, top_p: float) -> None:
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    draws = 40_000
    torch.manual_seed(0)
    tokens = next_tokens(probs.log().expand(draws, 4), Sampling(temperature, top_p))
    freq = torch.bincount(tokens, minlength=4).double() / draws
    want = probs.double() ** (1 / temperature)
    if top_p < 1.0:
        want[2:] = 0.0  # 0.4 + 0.3 reach 0.65
    want /= want.sum()
    assert torch.allclose(freq, want, atol=4 * (0.25 / draws) ** 0.5)


def test_top_k_keeps_the_k_largest_logits_and_their_ties() -> None:
    logits = torch.tensor([[0.1, 2.0, -1.0, 0.5], [3.0, 0.0, 3.0, 1.0]])
    kept = [torch.isfinite(top_k(logits, k)).tolist() for k in (1, 2, 0)]
    assert kept == [[[False, True, False, False], [True, False, True, False]],
                    [[False, True, False, True], [True, False, True, False]],
                    [[True] * 4, [True] * 4]]


@pytest.mark.parametrize(("k", "top_p", "want"), [(2, 1.0, [4, 3, 0, 0]), (3, 0.75, [4, 3, 0, 0]),
                                                  (4, 0.75, [4, 3, 2, 0])])
def test_drawn_tokens_follow_the_top_k_then_the_nucleus_of_those(k: int, top_p: float, want: list[float]) -> None:
    """The nucleus is taken over the k tokens' renormalised probabilities: of 0.4, 0.3, 0.2 (4/9, 3/9, 2/9) two
    reach 0.75, where over all four tokens it takes three."""
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    draws = 40_000
    torch.manual_seed(0)
    tokens = next_tokens(probs.log().expand(draws, 4), Sampling(1.0, top_p, k))
    freq = torch.bincount(tokens, minlength=4).double() / draws
    expected = torch.tensor(want, dtype=torch.double) / sum(want)
    assert torch.allclose(freq, expected, atol=4 * (0.25 / draws) ** 0.5)


def test_greedy_is_the_argmax() -> None:
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 2.9]])
    assert next_tokens(logits, Sampling(0.0)).tolist() == [1, 0]
