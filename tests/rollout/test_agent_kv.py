"""KV reuse across turns: the session path (each trajectory keeps its cache, a turn prefills
only its new tokens) must give the very tokens of the path that re-prefills the whole
conversation every turn, while feeding the model far fewer tokens.

The model is a tiny float64 Llama over a character tokenizer with ChatML special tokens, so
that batched, padded and holed forward passes agree far below any gap between logits. Its
text never forms an action: every turn is corrected, and rows end turns at different steps
(stop strings, EOS, max_new_tokens) and leave at different turns (the response budget).
"""

import os

import pytest
import torch
from test_chat import chat_tokenizer
from transformers import AutoModelForCausalLM

from grouprl.config import AgentConfig
from grouprl.data.sample import Sample
from grouprl.rollout.agent import AgentLoop
from grouprl.rollout.engines.hf import HFEngine, SamplingParams
from grouprl.rollout.engines.streams import RowStreams
from helpers import random_prompts, tiny_config

QUESTIONS = ["Who wrote it", "Name the river", "2+2"]


@pytest.fixture(scope="module")
def policy():
    tokenizer = chat_tokenizer("chatml")
    config = tiny_config(
        "llama", vocab_size=len(tokenizer), initializer_range=0.2, eos_token_id=tokenizer.eos_token_id
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float64).eval()
    return model, tokenizer


def run_loop(policy, reuse, params, n=2, generator=None, **cfg):
    model, tokenizer = policy
    engine = HFEngine(model, tokenizer)
    fed = []  # tokens per forward call with more than one position: the prefills
    hook = model.register_forward_pre_hook(
        lambda module, args, kwargs: (
            fed.append(kwargs["input_ids"].numel()) if kwargs["input_ids"].shape[1] > 1 else None
        ),
        with_kwargs=True,
    )
    try:
        cfg = dict(
            system_prompt="Search with <search>, then answer with <answer>.", answer_generator="none", **cfg
        )
        loop = AgentLoop(engine, tokenizer, {}, AgentConfig(reuse_kv_cache=reuse, **cfg), None)
        batch = [
            Sample(uid=f"u{i}", messages=[{"role": "user", "content": q}]) for i, q in enumerate(QUESTIONS)
        ]
        trajectories = loop.run(batch, loop.encode_prompts(batch), n, params, generator)
    finally:
        hook.remove()
    return trajectories, engine, sum(fed)


def test_greedy_reuse_equals_reprefill_and_prefills_less(policy):
    params = SamplingParams(max_new_tokens=12, temperature=0.0, stop=["D", "r"])
    cfg = dict(max_turns=4, max_response_tokens=265)
    reused, reuse_engine, reuse_fed = run_loop(policy, True, params, **cfg)
    again, again_engine, again_fed = run_loop(policy, False, params, **cfg)

    assert [t.response_ids for t in reused] == [t.response_ids for t in again]
    assert [t.loss_mask for t in reused] == [t.loss_mask for t in again]
    # the case is not trivial: turns ended by stop strings, EOS and length, rows left at different turns
    assert {r["finish_reason"] for t in reused for r in t.turns} == {"stop", "eos", "length"}
    assert len({len(t.turns) for t in reused}) > 1
    assert len({tuple(t.response_ids) for t in reused}) >= 2

    # the session feeds, after the prompts, only each observation and the token before it
    prompts = [t.prompt_ids for t in reused[::2]]
    common = len(os.path.commonprefix(prompts))  # >= 16: the shared system prompt is prefilled once
    prompts_fed = common + sum(len(p) - common for p in prompts)
    expected = prompts_fed + sum(
        1 + r["masked_tokens"] for t in reused for r in t.turns if r["masked_tokens"]
    )
    assert reuse_engine.prefill_tokens == expected
    assert again_engine.prefill_tokens > reuse_engine.prefill_tokens + 250  # >= one re-fed observation
    assert reuse_fed + 250 < again_fed  # counted independently, padding included


@pytest.mark.parametrize("schedule", ["turn", "trajectory"])
def test_seeded_sampling_reuse_equals_reprefill(policy, schedule):
    """Both paths draw the same numbers for the same rows: in lock step from one generator in
    batch order; one trajectory at a time from each row's own stream (its turns join a running
    batch with KV reuse; without, the turns queued at a step run together)."""
    params = SamplingParams(max_new_tokens=10, temperature=1.0, stop=["a", "e", "o"])

    def randomness():
        return torch.Generator().manual_seed(1) if schedule == "turn" else RowStreams(1, range(2 * len(QUESTIONS)))

    reused, _, _ = run_loop(policy, True, params, n=2, generator=randomness(), max_turns=3, schedule=schedule)
    again, _, _ = run_loop(policy, False, params, n=2, generator=randomness(), max_turns=3, schedule=schedule)
    assert [t.response_ids for t in reused] == [t.response_ids for t in again]
    assert {r["finish_reason"] for t in reused for r in t.turns} == {"stop", "eos", "length"}
    assert len({tuple(t.response_ids) for t in reused}) == 2 * len(QUESTIONS)  # every sample its own


@pytest.mark.parametrize("share_prompt_prefill", [True, False])
def test_session_continuations_equal_generate_on_the_whole_context(policy, share_prompt_prefill):
    """KVSession directly: rows continue in any order and subset, with new tokens of
    different lengths; each continuation equals generate() on that row's whole context."""
    model, tokenizer = policy
    engine = HFEngine(model, tokenizer, share_prompt_prefill=share_prompt_prefill)
    params = SamplingParams(max_new_tokens=6, temperature=0.0, stop=["D", "Y", "r"])
    prompts, n = random_prompts([5, 9], len(tokenizer), seed=3), 2
    session = engine.open_session(prompts, n)
    contexts = [list(prompts[r // n]) for r in range(len(prompts) * n)]
    model.train()  # the session leaves the model as it found it
    calls = [([0, 1, 2, 3], [5, 0, 0, 0]), ([0, 2, 3], [3, 7, 1]), ([3, 0], [4, 2]), ([1], [2])]
    for step, (rows, new_lengths) in enumerate(calls):
        new_tokens = [
            random_prompts([k], len(tokenizer), seed=10 * step + r)[0] if k else []
            for r, k in zip(rows, new_lengths)
        ]
        if step == 0:
            new_tokens = [[] for _ in rows]
        for r, ids in zip(rows, new_tokens):
            contexts[r] += ids
        got = session.generate(rows, new_tokens, params)
        expected = engine.generate([contexts[r] for r in rows], 1, params)
        assert [(g.token_ids, g.finish_reason) for g in got] == [
            (g.token_ids, g.finish_reason) for g in expected
        ]
        for r, g in zip(rows, got):
            contexts[r] += g.token_ids
    assert model.training
    model.eval()
    session.release(1)
    assert session.parked[1] is None and session.parked[0] is not None
