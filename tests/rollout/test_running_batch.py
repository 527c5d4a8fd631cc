"""The built-in engine's running batch (`RunningSession`, the `trajectory` schedule): a returning
row's new tokens go through the running rows' next decode step, one forward pass for both, and
every row still gets what generate() on its whole context gives.

A tiny float64 model over a character tokenizer, greedy: batched, padded and packed passes agree
far below any gap between two logits, so the tokens must be equal, and the logits to 1e-10.
"""

import pytest
import torch
from test_chat import chat_tokenizer
from transformers import AutoModelForCausalLM

from grouprl.rollout.engines.hf import HFEngine, SamplingParams
from grouprl.rollout.engines.running_batch import joins_in_step
from helpers import random_prompts, tiny_config


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def policy(request):
    tokenizer = chat_tokenizer("chatml")
    config = tiny_config(request.param, vocab_size=len(tokenizer), initializer_range=0.2, eos_token_id=tokenizer.eos_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float64).eval()
    return model, tokenizer


def passes(model):
    """Every forward of `model`: its input ids' shape."""
    shapes = []
    hook = model.register_forward_pre_hook(
        lambda module, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    return shapes, hook


def test_a_returning_row_is_prefilled_inside_the_running_rows_step(policy):
    model, tokenizer = policy
    engine = HFEngine(model, tokenizer)
    prompts, n = random_prompts([5, 9], len(tokenizer), seed=3), 2
    session = engine.open_session(prompts, n)
    assert session.in_step  # a text model on sdpa
    short = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)
    long = SamplingParams(max_new_tokens=9, temperature=0.0, ignore_eos=True)
    contexts = [list(prompts[r // n]) for r in range(4)]
    for row in range(4):
        session.submit(row, [], short if row < 2 else long)
    done = {}
    for _ in range(2):  # rows 0 and 1 end their first turn; 2 and 3 run on
        done.update(session.step())
    assert sorted(done) == [0, 1] and len(session.running) == 2
    observations = {0: random_prompts([7], len(tokenizer), seed=11)[0], 1: random_prompts([3], len(tokenizer), seed=12)[0]}
    for row in (0, 1):
        contexts[row] += done[row].token_ids + observations[row]
        session.submit(row, observations[row], long)
    shapes, hook = passes(model)
    try:
        done.update(session.step())
    finally:
        hook.remove()
    # one pass: rows 2 and 3's next tokens and rows 0 and 1's last token and observation, side by side
    assert shapes == [(1, 2 + (1 + 7) + (1 + 3))]
    assert [turn.row for turn in session.running] == [2, 3, 0, 1]
    # the joined rows' next-token logits are those of a forward over their whole context
    for slot, row in ((2, 0), (3, 1)):
        with torch.no_grad():
            whole = model(input_ids=torch.tensor([contexts[row]])).logits[0, -1]
        torch.testing.assert_close(session.logits[slot], whole, rtol=0, atol=1e-10)
    results = {0: [], 1: [], 2: [], 3: []}
    while session.running or session.queued:
        for row, generation in session.step():
            results[row] = generation.token_ids
    for row in (2, 3):
        results[row] = done[row].token_ids if row in done else results[row]
    expected = engine.generate([contexts[r] for r in range(4)], 1, long)
    for row in (0, 1):  # the second turns, after the observation
        assert results[row] == expected[row].token_ids
    first_turns = engine.generate([list(prompts[r // n]) for r in (2, 3)], 1, long)
    assert [results[2], results[3]] == [g.token_ids for g in first_turns]
    assert engine.running_turns == 0


def test_all_running_rows_end_as_rows_return(policy):
    """The running rows all end in the step that feeds returning rows: the pass holds only theirs."""
    model, tokenizer = policy
    engine = HFEngine(model, tokenizer)
    prompts = random_prompts([6], len(tokenizer), seed=5)
    session = engine.open_session(prompts, 2)
    one = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    three = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
    session.submit(0, [], one)
    session.submit(1, [], three)
    first = dict(session.step())  # row 0 ends; row 1 runs
    observation = random_prompts([4], len(tokenizer), seed=8)[0]
    session.submit(0, observation, three)
    shapes, hook = passes(model)
    try:
        session.step()  # row 1's second token with row 0's observation
        session.step()  # row 1 ends here, alone in its step
    finally:
        hook.remove()
    assert shapes[0] == (1, 1 + 1 + 4)
    results = {}
    while session.running:
        results.update({row: g.token_ids for row, g in session.step()})
    expected = engine.generate([prompts[0] + first[0].token_ids + observation], 1, three)[0]
    assert results[0] == expected.token_ids


def test_the_joined_rows_logits_at_bf16():
    """A bf16 model (what `actor.dtype=auto` picks on a CPU with bf16 support, and on GPUs): the
    same pass, within bf16's rounding of the whole-context logits."""
    tokenizer = chat_tokenizer("chatml")
    config = tiny_config("llama", vocab_size=len(tokenizer), initializer_range=0.2, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    engine = HFEngine(model, tokenizer)
    prompts = random_prompts([5, 8], len(tokenizer), seed=4)
    session = engine.open_session(prompts, 1)
    one = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    session.submit(0, [], one)
    session.submit(1, [], SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True))
    first = dict(session.step())
    observation = random_prompts([6], len(tokenizer), seed=9)[0]
    session.submit(0, observation, one)
    session.step()
    assert [turn.row for turn in session.running] == [1, 0]
    with torch.no_grad():
        whole = model(input_ids=torch.tensor([prompts[0] + first[0].token_ids + observation])).logits[0, -1]
    assert session.logits.dtype == torch.bfloat16
    torch.testing.assert_close(session.logits[1].float(), whole.float(), rtol=0, atol=0.05 * whole.float().abs().max().item())


def test_a_vlm_or_another_attention_prefills_in_a_pass_of_its_own(policy):
    model, tokenizer = policy
    engine = HFEngine(model, tokenizer)
    assert joins_in_step(engine)
    engine.vision = object()
    assert not joins_in_step(engine)
    engine.vision = None
    model.config._attn_implementation_internal = "eager"
    try:
        assert not joins_in_step(engine)
    finally:
        model.config._attn_implementation_internal = "sdpa"
