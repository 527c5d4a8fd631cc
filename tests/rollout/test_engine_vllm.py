"""The vLLM engine against the hf engine and the trainer's own log-probs, on a tiny Llama built
here (head size 32, which vLLM's CPU attention supports), in-process on vLLM's CPU build.

These tests run in the vLLM environment (`make test` runs them there: `-m vllm`); without vLLM
they fail at the import, never skip silently.
"""

import pytest
import torch

from grouprl.rollout.engines.hf import HFEngine, SamplingParams
from helpers import reference_log_probs, tiny_model_and_tokenizer

pytestmark = pytest.mark.vllm

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0)
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1)


class EngineSettings:  # the rollout config's vLLM fields and the training sampling settings
    gpu_memory_utilization = 0.5
    kv_cache_gb = 0.25
    tensor_parallel_size = 1
    sleep_level = 1
    enforce_eager = True
    max_model_len = 256
    temperature = 1.0
    top_k = 0
    top_p = 1.0


class TruncatingSettings(EngineSettings):  # top-p at temperature 1: vLLM's raw log-probs
    top_p = 0.8


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-vllm")
    tiny_model_and_tokenizer(path, init_std=0.2, **TINY)
    return path


@pytest.fixture(scope="module")
def engine(folder):
    from grouprl.rollout.engines.vllm import VLLMEngine

    model, tokenizer = tiny_model_and_tokenizer(init_std=0.2, **TINY)
    return VLLMEngine(model, tokenizer, str(folder), EngineSettings, seed=0, max_model_len=256)


def fresh_model(seed: int):
    """The tiny model with every weight (embeddings and head included) moved by seeded noise."""
    model, tokenizer = tiny_model_and_tokenizer(init_std=0.2, **TINY)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=generator))
    return model, tokenizer


def prompts_of(tokenizer, texts):
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


@pytest.mark.parametrize("seed", [1, 2])
def test_after_a_push_greedy_decoding_equals_the_hf_engine(engine, seed):
    model, tokenizer = fresh_model(seed)
    engine.weights_updated(model)
    prompts = prompts_of(tokenizer, ["abc def", "x", "hello world, again"])
    got = engine.generate(prompts, 1, GREEDY)
    want = HFEngine(model, tokenizer).generate(prompts, 1, GREEDY)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert [g.finish_reason for g in got] == [w.finish_reason for w in want]
    assert [g.text for g in got] == [w.text for w in want]


def sampled_and_trainer_log_probs(engine, params, seed):
    """(vLLM's log-probs, the trainer's at params.temperature, mask) of 2 prompts x 4 samples."""
    model, tokenizer = fresh_model(seed)
    engine.weights_updated(model)
    prompts = prompts_of(tokenizer, ["abc", "the cat"])
    generations = engine.generate(prompts, 4, params, torch.Generator().manual_seed(0))
    width = max(len(g.token_ids) for g in generations)
    response = torch.zeros((len(generations), width), dtype=torch.long)
    mask = torch.zeros((len(generations), width), dtype=torch.long)
    engine_lp = torch.zeros((len(generations), width), dtype=torch.float64)
    for i, g in enumerate(generations):
        response[i, : len(g.token_ids)] = torch.tensor(g.token_ids)
        mask[i, : len(g.token_ids)] = 1
        engine_lp[i, : len(g.log_probs)] = torch.tensor(g.log_probs, dtype=torch.float64)
    with torch.no_grad():
        trainer_lp, _ = reference_log_probs(model, [p for p in prompts for _ in range(4)], response, mask, params.temperature)
    return engine_lp, trainer_lp, mask.bool()


def test_sampled_log_probs_match_the_trainers(engine):
    """Temperature 0.7: vLLM reports log softmax(logits / 0.7) of each sampled token, which is
    what the trainer computes for the loss."""
    engine_lp, trainer_lp, mask = sampled_and_trainer_log_probs(engine, SamplingParams(max_new_tokens=10, temperature=0.7), 3)
    diff = (trainer_lp - engine_lp)[mask].abs()
    assert diff.numel() == int(mask.sum()) > 0
    assert diff.max() < 1e-4, diff.max()


def test_lora_is_merged_into_the_push_and_the_model_is_left_as_it_was(engine):
    peft = pytest.importorskip("peft")
    base, tokenizer = fresh_model(4)
    model = peft.get_peft_model(
        base, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine.weights_updated(model)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    prompts = prompts_of(tokenizer, ["abc def", "zz"])
    got = engine.generate(prompts, 1, GREEDY)
    want = HFEngine(model, tokenizer).generate(prompts, 1, GREEDY)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]


def test_samples_follow_the_generator_and_groups_arrive_whole(engine):
    model, tokenizer = fresh_model(5)
    engine.weights_updated(model)
    prompts = prompts_of(tokenizer, ["abc", "de", "fgh"])
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    groups = []
    first = engine.generate(
        prompts, 3, params, torch.Generator().manual_seed(7), on_group_done=lambda i, g: groups.append((i, g))
    )
    again = engine.generate(prompts, 3, params, torch.Generator().manual_seed(7))
    other = engine.generate(prompts, 3, params, torch.Generator().manual_seed(8))
    assert len(first) == 9 and [g.token_ids for g in first] == [g.token_ids for g in again]
    assert [g.token_ids for g in first] != [g.token_ids for g in other]
    assert sorted(i for i, _ in groups) == [0, 1, 2]
    for i, group in groups:  # each group handed over once, whole, with the samples returned
        assert [g.token_ids for g in group] == [g.token_ids for g in first[i * 3 : i * 3 + 3]]
    # the samples of a group differ (one request with n = 3, not one sample copied)
    assert len({tuple(g.token_ids) for g in first[:3]}) > 1
    state = torch.get_rng_state()
    engine.generate(prompts, 1, params, torch.Generator().manual_seed(9))
    assert torch.equal(state, torch.get_rng_state())  # the trainer's global generator is untouched


def test_stop_strings_end_a_sample_as_in_the_hf_engine(engine):
    model, tokenizer = fresh_model(6)
    engine.weights_updated(model)
    prompts = prompts_of(tokenizer, ["abc def", "hello", "x y z", "q"])
    hf = HFEngine(model, tokenizer)
    free = hf.generate(prompts, 1, SamplingParams(max_new_tokens=16, temperature=0.0))
    # a stop string taken from the middle of each greedy continuation, so every sample stops
    stops = sorted({g.text[3:5] for g in free if len(g.text) >= 5})
    params = SamplingParams(max_new_tokens=16, temperature=0.0, stop=stops)
    got, want = engine.generate(prompts, 1, params), hf.generate(prompts, 1, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert [g.finish_reason for g in got] == [w.finish_reason for w in want]
    assert "stop" in [g.finish_reason for g in got]


def test_a_session_feeds_whole_conversations_with_the_same_turns_as_hf(engine):
    model, tokenizer = fresh_model(7)
    engine.weights_updated(model)
    prompts = prompts_of(tokenizer, ["abc", "defg"])
    params = SamplingParams(max_new_tokens=5, temperature=0.0)
    turns = []
    for e in (engine, HFEngine(model, tokenizer)):
        session = e.open_session(prompts, 2)
        first = session.generate([0, 1, 2, 3], [[], [], [], []], params)
        second = session.generate([0, 3], prompts_of(tokenizer, ["!?", "ok"]), params)
        turns.append(([g.token_ids for g in first], [g.token_ids for g in second]))
    assert turns[0] == turns[1]


def test_with_top_p_at_temperature_1_the_log_probs_are_the_untruncated_ones(engine, folder):
    """Top-p 0.8: the engine started for it takes vLLM's raw log-probs, the whole distribution's,
    which the trainer computes; the processed ones (of the engine started without truncation)
    are the kept tokens' renormalised log-probs, above the trainer's by -log(kept mass)."""
    from grouprl.rollout.engines.vllm import VLLMEngine

    # in-process engines share vLLM's parallel groups, which an engine's shutdown tears down:
    # tests starting an engine of their own come after the module engine's last other use
    model, tokenizer = tiny_model_and_tokenizer(init_std=0.2, **TINY)
    raw = VLLMEngine(model, tokenizer, str(folder), TruncatingSettings, seed=0, max_model_len=256)
    assert raw.logprobs_mode == "raw_logprobs" and engine.logprobs_mode == "processed_logprobs"
    params = SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.8)
    engine_lp, trainer_lp, mask = sampled_and_trainer_log_probs(raw, params, 9)
    assert (trainer_lp - engine_lp)[mask].abs().max() < 1e-4
    engine_lp, trainer_lp, mask = sampled_and_trainer_log_probs(engine, params, 9)
    above = (engine_lp - trainer_lp)[mask]
    assert above.min() > -1e-4 and above.max() > 1e-2  # the truncation, not the numbers


def test_an_agent_episode_on_vllm_has_the_hf_engines_tokens_and_masks(tmp_path):
    """The agent loop on both engines, greedy, a ChatML tokenizer: the policy's text never forms
    an action, so every turn is corrected with an observation (mask 0) and turns end by stop
    strings or length. Same ids, same masks; the engine's log-probs sit under mask 1 only."""
    from test_chat import chat_tokenizer
    from transformers import AutoModelForCausalLM

    from grouprl.config import AgentConfig
    from grouprl.data.sample import Sample
    from grouprl.rollout.agent import AgentLoop
    from grouprl.rollout.engines.vllm import VLLMEngine
    from helpers import tiny_config

    tokenizer = chat_tokenizer("chatml")
    config = tiny_config("llama", vocab_size=len(tokenizer), initializer_range=0.2, eos_token_id=tokenizer.eos_token_id, **TINY)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    questions = ["Who wrote it", "Name the river", "2+2"]
    batch = [Sample(uid=f"u{i}", messages=[{"role": "user", "content": q}]) for i, q in enumerate(questions)]
    params = SamplingParams(max_new_tokens=12, temperature=0.0, stop=["D", "r"])
    cfg = AgentConfig(
        system_prompt="Search with <search>, then answer with <answer>.",
        answer_generator="none",
        max_turns=4,
        max_response_tokens=265,
    )
    runs = []
    for engine in (HFEngine(model, tokenizer), VLLMEngine(model, tokenizer, str(tmp_path), EngineSettings)):
        loop = AgentLoop(engine, tokenizer, {}, cfg, None)
        runs.append(loop.run(batch, loop.encode_prompts(batch), 2, params))
    hf, vllm = runs
    assert [t.response_ids for t in vllm] == [t.response_ids for t in hf]
    assert [t.loss_mask for t in vllm] == [t.loss_mask for t in hf]
    assert {"stop", "length"} <= {r["finish_reason"] for t in vllm for r in t.turns}
    assert all(0 in t.loss_mask and 1 in t.loss_mask for t in vllm)
    for t in vllm:  # log-probs of policy tokens (finite, < 0); zeros under the observations
        lp = torch.tensor(t.rollout_log_probs)
        mask = torch.tensor(t.loss_mask).bool()
        assert len(lp) == len(t.response_ids) and bool((lp[mask] < 0).all()) and bool((lp[~mask] == 0).all())
    assert all(t.rollout_log_probs is None for t in hf)


def test_the_agent_on_vllm_samples_the_same_trajectories_in_both_schedules(tmp_path):
    """One request per turn, joining vLLM's running batch (trajectory) or one generate call per
    turn (turn): each turn's request is seeded from its row's stream either way (a prompt's n
    first turns as one request of n samples, seed + j, or as n requests of one), so sampling
    at temperature 1 gives the same tokens; the engine holds no request afterwards."""
    from test_chat import chat_tokenizer
    from transformers import AutoModelForCausalLM

    from grouprl.config import AgentConfig
    from grouprl.data.sample import Sample
    from grouprl.rollout.agent import AgentLoop
    from grouprl.rollout.engines.streams import RowStreams
    from grouprl.rollout.engines.vllm import VLLMEngine
    from helpers import tiny_config

    tokenizer = chat_tokenizer("chatml")
    config = tiny_config("llama", vocab_size=len(tokenizer), initializer_range=0.2, eos_token_id=tokenizer.eos_token_id, **TINY)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    batch = [Sample(uid=f"u{i}", messages=[{"role": "user", "content": q}]) for i, q in enumerate(["Who wrote it", "2+2"])]
    params = SamplingParams(max_new_tokens=12, temperature=1.0, stop=["D", "r"])
    engine = VLLMEngine(model, tokenizer, str(tmp_path), EngineSettings)
    runs = {}
    for schedule in ("turn", "trajectory"):
        cfg = AgentConfig(system_prompt="Search.", answer_generator="none", max_turns=4, max_response_tokens=150, schedule=schedule)
        loop = AgentLoop(engine, tokenizer, {}, cfg, None)
        runs[schedule] = loop.run(batch, loop.encode_prompts(batch), 3, params, RowStreams(5, range(6)))
        assert engine.running_turns == 0 and not engine.llm.llm_engine.has_unfinished_requests()
    assert [t.response_ids for t in runs["trajectory"]] == [t.response_ids for t in runs["turn"]]
    assert [t.loss_mask for t in runs["trajectory"]] == [t.loss_mask for t in runs["turn"]]
    assert len({tuple(t.response_ids) for t in runs["turn"]}) == 6  # every sample its own
    assert {"stop", "length"} <= {r["finish_reason"] for t in runs["turn"] for r in t.turns}


def test_an_engine_starts_with_llvmlite_loaded(folder):
    """vLLM's CPU build scans every loaded module at start-up; llvmlite's `ffi.lib` (numba, which
    bm25s loads for the retriever) answers any attribute and used to break that scan."""
    pytest.importorskip("llvmlite")
    import llvmlite.binding  # noqa: F401 - loaded, as it is once the retriever's index is

    from grouprl.rollout.engines.vllm import VLLMEngine

    model, tokenizer = fresh_model(8)
    engine = VLLMEngine(model, tokenizer, str(folder), EngineSettings, seed=0, max_model_len=256)
    prompts = prompts_of(tokenizer, ["abc"])
    got = engine.generate(prompts, 1, GREEDY)
    assert [g.token_ids for g in got] == [w.token_ids for w in HFEngine(model, tokenizer).generate(prompts, 1, GREEDY)]
