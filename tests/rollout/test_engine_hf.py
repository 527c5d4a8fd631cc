"""HFEngine against transformers' own generate, and sample_next against hand-built distributions.

The model is float64 so that batched, padded and single-prompt forward passes agree far below
any gap between the top two logits: greedy outputs must then match token for token.
"""

import pytest
import torch

from grouprl.rollout.engines.hf import HFEngine, SamplingParams, sample_next
from grouprl.rollout.engines.streams import RowStreams
from helpers import byte_level_tokenizer, random_prompts, tiny_config, tiny_model_and_tokenizer

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0)
PROMPT_LENGTHS = [3, 7, 1, 12]


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return tiny_model_and_tokenizer(dtype=torch.float64, seed=0)


@pytest.fixture(scope="module")
def prompts(model_and_tokenizer):
    return random_prompts(PROMPT_LENGTHS, len(model_and_tokenizer[1]), seed=1)


@pytest.fixture(scope="module")
def alone(model_and_tokenizer, prompts):
    """Greedy continuation of each prompt generated on its own (batch of one, no padding)."""
    model, tokenizer = model_and_tokenizer
    engine = HFEngine(model, tokenizer)
    return [engine.generate([p], 1, GREEDY)[0].token_ids for p in prompts]


def hf_greedy(model, prompts, max_new_tokens):
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,  # never stop early: compare every position
        pad_token_id=0,
    )
    return out[:, width:].tolist()


def test_greedy_matches_transformers_generate(model_and_tokenizer, prompts, alone):
    model, tokenizer = model_and_tokenizer
    expected = hf_greedy(model, prompts, GREEDY.max_new_tokens)
    assert all(1 not in row for row in expected), "the fixture's greedy text must not hit EOS"
    generations = HFEngine(model, tokenizer).generate(prompts, 1, GREEDY)
    assert [g.token_ids for g in generations] == expected
    assert [g.finish_reason for g in generations] == ["length"] * len(prompts)
    assert [g.text for g in generations] == [tokenizer.decode(row) for row in expected]
    assert [g.token_ids for g in generations] == alone  # left padding changes nothing
    assert len({tuple(row) for row in expected}) == len(prompts)  # the prompts are told apart


def test_output_is_prompt_major(model_and_tokenizer, prompts, alone):
    model, tokenizer = model_and_tokenizer
    n = 3
    # max_batch 7 rows = 2 prompts x 3 samples per call: two calls
    for share, max_batch in ((True, 0), (False, 0), (True, 7)):
        engine = HFEngine(model, tokenizer, share_prompt_prefill=share, max_batch=max_batch)
        generations = engine.generate(prompts, n, GREEDY)
        assert len(generations) == len(prompts) * n
        for i in range(len(prompts)):
            for j in range(n):
                assert generations[i * n + j].token_ids == alone[i], (share, max_batch, i, j)


def test_share_prompt_prefill_gives_identical_greedy_and_seeded_samples(model_and_tokenizer, prompts):
    model, tokenizer = model_and_tokenizer
    sampling = SamplingParams(max_new_tokens=10, temperature=1.0)
    shared = HFEngine(model, tokenizer, share_prompt_prefill=True)
    separate = HFEngine(model, tokenizer, share_prompt_prefill=False)
    assert shared.generate(prompts, 3, GREEDY) == separate.generate(prompts, 3, GREEDY)
    samples_shared = shared.generate(prompts, 3, sampling, torch.Generator().manual_seed(3))
    samples_separate = separate.generate(prompts, 3, sampling, torch.Generator().manual_seed(3))
    assert samples_shared == samples_separate
    # the samples of one prompt really differ, so the equality above is not a greedy accident
    assert len({tuple(g.token_ids) for g in samples_shared[:3]}) > 1


def test_same_seed_same_samples_other_seed_other_samples(model_and_tokenizer, prompts):
    model, tokenizer = model_and_tokenizer
    engine = HFEngine(model, tokenizer)
    sampling = SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.9, top_k=20)
    first = engine.generate(prompts, 2, sampling, torch.Generator().manual_seed(7))
    again = engine.generate(prompts, 2, sampling, torch.Generator().manual_seed(7))
    other = engine.generate(prompts, 2, sampling, torch.Generator().manual_seed(8))
    assert first == again
    assert [g.token_ids for g in first] != [g.token_ids for g in other]


def test_row_streams_make_a_sample_independent_of_its_batch(model_and_tokenizer, prompts):
    """With per-trajectory streams a prompt's samples are the same alone, in a batch, in chunks,
    without the shared prefill and inside a multi-turn session: what ranks and resumes need."""
    model, tokenizer = model_and_tokenizer
    sampling = SamplingParams(max_new_tokens=10, temperature=1.0, top_k=20)
    n = 2
    keys = list(range(len(prompts) * n))
    together = HFEngine(model, tokenizer).generate(prompts, n, sampling, RowStreams(11, keys))
    assert len({tuple(g.token_ids) for g in together}) == len(together)  # really sampled
    for engine in (
        HFEngine(model, tokenizer, max_batch=3),
        HFEngine(model, tokenizer, share_prompt_prefill=False),
    ):
        assert engine.generate(prompts, n, sampling, RowStreams(11, keys)) == together
    for i, prompt in enumerate(prompts):  # one prompt alone, keyed by its place in the batch
        alone = HFEngine(model, tokenizer).generate(
            [prompt], n, sampling, RowStreams(11, keys[i * n : (i + 1) * n])
        )
        assert alone == together[i * n : (i + 1) * n], i
    session = HFEngine(model, tokenizer).open_session(prompts, n)
    assert session.generate(keys, [[] for _ in keys], sampling, RowStreams(11, keys)) == together
    other = HFEngine(model, tokenizer).generate(prompts, n, sampling, RowStreams(12, keys))
    assert [g.token_ids for g in other] != [g.token_ids for g in together]


def test_row_streams_are_uniform_and_independent_per_row():
    streams = RowStreams(3, range(50000))
    first, second = streams.uniform(dtype=torch.float64), streams.uniform(dtype=torch.float64)
    for u in (first, second):
        assert 0 <= float(u.min()) and float(u.max()) < 1
        assert abs(float(u.mean()) - 0.5) < 0.005 and abs(float(u.std()) - 12**-0.5) < 0.005  # ~4 s.e.
    assert abs(float(torch.corrcoef(torch.stack([first, second]))[0, 1])) < 0.02
    # a row's k-th draw is the same whatever other rows draw in between
    again = RowStreams(3, range(50000))
    again.select([7]).uniform(dtype=torch.float64)
    assert float(again.select([7]).uniform(dtype=torch.float64)[0]) == float(second[7])
    # float32 never rounds up to 1.0 (that would reach past the last token)
    assert float(RowStreams(3, range(50000)).uniform(dtype=torch.float32).max()) < 1.0


def test_top_k_1_is_greedy(model_and_tokenizer, prompts, alone):
    model, tokenizer = model_and_tokenizer
    engine = HFEngine(model, tokenizer)
    sampling = SamplingParams(max_new_tokens=GREEDY.max_new_tokens, temperature=1.0, top_k=1)
    generations = engine.generate(prompts, 2, sampling, torch.Generator().manual_seed(0))
    assert [g.token_ids for g in generations] == [row for row in alone for _ in range(2)]


def test_real_eos_ends_a_row_and_is_kept(model_and_tokenizer, prompts):
    model, tokenizer = model_and_tokenizer
    engine = HFEngine(model, tokenizer)
    assert engine.eos_token_ids == [tokenizer.eos_token_id]
    sampling = SamplingParams(max_new_tokens=10, temperature=1.0)
    generations = engine.generate(prompts, 3, sampling, torch.Generator().manual_seed(3))
    eos_rows = [g for g in generations if g.finish_reason == "eos"]
    assert eos_rows, "seed 3 samples EOS in some rows"
    for g in generations:
        assert tokenizer.eos_token_id not in g.token_ids[:-1]
        if g.finish_reason == "eos":
            assert g.token_ids[-1] == tokenizer.eos_token_id and len(g.token_ids) < 10
            assert g.text == tokenizer.decode(g.token_ids[:-1])  # special tokens left out of text
        else:
            assert g.finish_reason == "length" and len(g.token_ids) == 10


def test_eos_rows_leave_the_batch_without_changing_the_others(
    model_and_tokenizer, prompts, alone, monkeypatch
):
    """Make a token that greedy decoding reaches at different steps in different prompts an EOS
    token: each row must stop right after its first occurrence, and every row must still equal
    its alone-generated continuation (finished rows dropping out of the KV cache change nothing)."""
    model, tokenizer = model_and_tokenizer
    firsts = {}  # token -> first position in each continuation (None if absent)
    for tok in set(alone[0]) | set(alone[1]):
        firsts[tok] = [row.index(tok) if tok in row else None for row in alone]
    # a token that ends some rows early, at different steps, and is absent from another row
    stop_tok = max(
        firsts,
        key=lambda t: (None in firsts[t], len({p for p in firsts[t] if p is not None})),
    )
    positions = firsts[stop_tok]
    assert None in positions and len({p for p in positions if p is not None}) >= 2, positions

    monkeypatch.setattr(model.generation_config, "eos_token_id", [tokenizer.eos_token_id, stop_tok])
    engine = HFEngine(model, tokenizer)
    assert engine.eos_token_ids == sorted([tokenizer.eos_token_id, stop_tok])
    for share in (True, False):
        engine.share_prompt_prefill = share
        generations = engine.generate(prompts, 2, GREEDY)
        for k, g in enumerate(generations):
            row, pos = alone[k // 2], positions[k // 2]
            if pos is None:
                assert (g.token_ids, g.finish_reason) == (row, "length")
            else:
                assert (g.token_ids, g.finish_reason) == (row[: pos + 1], "eos")


def test_stop_string_ends_with_stop_and_text_contains_it(model_and_tokenizer, prompts, alone):
    model, tokenizer = model_and_tokenizer
    texts = [tokenizer.decode(row) for row in alone]
    assert all(min(row) >= 3 for row in alone[:2]), "character tokens only, so text positions = tokens"
    stop = texts[0][4:6]  # ends at token 5 (or earlier if it already occurred)
    first_end = next(j for j in range(len(texts[0])) if stop in texts[0][: j + 1])
    engine = HFEngine(model, tokenizer)
    sampling = SamplingParams(max_new_tokens=GREEDY.max_new_tokens, temperature=0.0, stop=["@@never@@", stop])
    generations = engine.generate(prompts, 1, sampling)
    assert generations[0].finish_reason == "stop"
    assert generations[0].token_ids == alone[0][: first_end + 1]
    assert generations[0].text.endswith(stop) and generations[0].text == texts[0][: first_end + 1]
    for g, row, text in zip(generations[1:], alone[1:], texts[1:]):
        if stop in text:
            assert g.finish_reason == "stop" and stop in g.text and text.startswith(g.text)
        else:
            assert (g.token_ids, g.finish_reason) == (row, "length")


def test_common_prompt_prefix_prefilled_once_changes_nothing(model_and_tokenizer):
    """Prompts that open with the same 20 tokens (one of them is exactly that opening): the shared
    opening is prefilled once and its cache expanded, then the suffixes are prefilled with
    padding between the two. Greedy text must equal transformers' own generate, and seeded samples
    must equal the engine with the common-prefix path switched off."""
    model, tokenizer = model_and_tokenizer
    opening = random_prompts([20], len(tokenizer), seed=5)[0]
    prompts = [opening + tail for tail in random_prompts([3, 0, 7, 1], len(tokenizer), seed=6)]
    expected = hf_greedy(model, prompts, GREEDY.max_new_tokens)
    common = HFEngine(model, tokenizer, min_common_prefix=16)
    plain = HFEngine(model, tokenizer, min_common_prefix=10**9)
    generations = common.generate(prompts, 2, GREEDY)
    assert [g.token_ids for g in generations] == [row for row in expected for _ in range(2)]
    sampling = SamplingParams(max_new_tokens=8, temperature=1.0)
    samples = common.generate(prompts, 2, sampling, torch.Generator().manual_seed(4))
    assert samples == plain.generate(prompts, 2, sampling, torch.Generator().manual_seed(4))


def test_stop_string_ending_in_a_space_with_a_byte_level_tokenizer():
    """A model that prefers a space after 'hello': stop=[" "] must end the row at once."""
    from transformers import AutoModelForCausalLM

    tokenizer = byte_level_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        config = tiny_config(vocab_size=len(tokenizer), initializer_range=0.2, tie_word_embeddings=False)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float64).eval()
    engine = HFEngine(model, tokenizer)
    prompt = tokenizer("hello")["input_ids"]
    first = engine.generate([prompt], 1, SamplingParams(max_new_tokens=1, temperature=0.0))[0].token_ids[0]
    space = tokenizer.convert_tokens_to_ids("Ġ")
    with torch.no_grad():  # the space's output row: 3 x the row of the token greedy picked
        model.lm_head.weight[space] = 3 * model.lm_head.weight[first]
    greedy = engine.generate([prompt], 1, SamplingParams(max_new_tokens=4, temperature=0.0))[0]
    assert greedy.token_ids[0] == space and greedy.text.startswith(" ")
    stopped = engine.generate([prompt], 1, SamplingParams(max_new_tokens=4, temperature=0.0, stop=[" "]))[0]
    assert (stopped.token_ids, stopped.finish_reason) == ([space], "stop")


def test_max_new_tokens_gives_length(model_and_tokenizer, prompts, alone):
    model, tokenizer = model_and_tokenizer
    engine = HFEngine(model, tokenizer)
    for k in (1, 5):
        generations = engine.generate(prompts, 2, SamplingParams(max_new_tokens=k, temperature=0.0))
        assert [g.token_ids for g in generations] == [row[:k] for row in alone for _ in range(2)]
        assert {g.finish_reason for g in generations} == {"length"}


def test_training_mode_is_restored(model_and_tokenizer, prompts):
    model, tokenizer = model_and_tokenizer
    model.train()
    try:
        HFEngine(model, tokenizer).generate(prompts[:1], 1, SamplingParams(max_new_tokens=2, temperature=0))
        assert model.training
    finally:
        model.eval()


# ---------------------------------------------------------------- sample_next by hand


class MultinomialSpy:
    """Records the probabilities sample_next hands to its sampler."""

    def __init__(self, monkeypatch):
        from grouprl.rollout.engines import sampling as hf_engine

        self.probs = []
        real = hf_engine._inverse_cdf_sample

        def spy(probs, *args, **kwargs):
            self.probs.append(probs.detach().clone())
            return real(probs, *args, **kwargs)

        monkeypatch.setattr(hf_engine, "_inverse_cdf_sample", spy)


def test_inverse_cdf_draws_follow_the_distribution_and_never_a_zero():
    """Zero-probability tokens first, in the middle and last are never drawn; frequencies match."""
    from grouprl.rollout.engines.sampling import _inverse_cdf_sample

    probs = torch.tensor([[0.0, 0.1, 0.0, 0.6, 0.3, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0, 1.0]])
    draws = _inverse_cdf_sample(probs.repeat(20000, 1), torch.Generator().manual_seed(0)).view(20000, 2)
    assert draws[:, 1].eq(5).all()
    counts = torch.bincount(draws[:, 0], minlength=6).double() / 20000
    assert counts[0] == counts[2] == counts[5] == 0
    torch.testing.assert_close(counts, probs[0].double(), rtol=0, atol=0.015)  # ~5 standard errors
    # unnormalised weights draw the same way (the total is read off the cumulative sum)
    again = _inverse_cdf_sample(probs.repeat(20000, 1) * 7, torch.Generator().manual_seed(0)).view(20000, 2)
    assert torch.equal(again, draws)


def nucleus(probs: list[float], top_p: float) -> list[float]:
    """Reference: keep the smallest prefix of the descending distribution with mass >= top_p."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept, mass = set(), 0.0
    for i in order:
        kept.add(i)
        mass += probs[i]
        if mass >= top_p:
            break
    total = sum(probs[i] for i in kept)
    return [probs[i] / total if i in kept else 0.0 for i in range(len(probs))]


PROBS = [0.1, 0.4, 0.05, 0.3, 0.15]  # sorted: 0.4, 0.3, 0.15, 0.1, 0.05 -> cumsum .4 .7 .85 .95 1


@pytest.mark.parametrize("top_p", [0.3, 0.5, 0.69, 0.71, 0.8, 0.9, 0.97, 1.0])
def test_top_p_keeps_the_smallest_prefix_with_enough_mass(top_p, monkeypatch):
    spy = MultinomialSpy(monkeypatch)
    logits = torch.tensor([PROBS, PROBS[::-1]]).log()  # two rows, different orders
    sample_next(logits, SamplingParams(temperature=1.0, top_p=top_p), torch.Generator().manual_seed(0))
    expected = torch.tensor([nucleus(PROBS, top_p), nucleus(PROBS[::-1], top_p)])
    torch.testing.assert_close(spy.probs[0], expected, rtol=0, atol=1e-6)


def test_top_p_at_an_exact_mass_boundary(monkeypatch):
    spy = MultinomialSpy(monkeypatch)
    logits = torch.zeros(1, 4)  # probabilities exactly 0.25: cumulative mass 0.5 is exact in float
    sample_next(logits, SamplingParams(temperature=1.0, top_p=0.5), torch.Generator().manual_seed(0))
    assert int((spy.probs[0] > 0).sum()) == 2
    torch.testing.assert_close(
        spy.probs[0].sort(descending=True).values, torch.tensor([[0.5, 0.5, 0.0, 0.0]])
    )


def test_top_k_masks_all_but_the_k_largest_and_combines_with_top_p(monkeypatch):
    spy = MultinomialSpy(monkeypatch)
    logits = torch.tensor([PROBS]).log()
    sample_next(logits, SamplingParams(temperature=1.0, top_k=3), None)
    torch.testing.assert_close(
        spy.probs[0], torch.tensor([[0.0, 0.4, 0.0, 0.3, 0.15]]) / 0.85, rtol=0, atol=1e-6
    )
    # top-k first (0.4, 0.3, 0.15 renormalised: .47 .35 .18), then top-p 0.8 keeps the first two
    sample_next(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.8), None)
    torch.testing.assert_close(
        spy.probs[1], torch.tensor([[0.0, 0.4, 0.0, 0.3, 0.0]]) / 0.7, rtol=0, atol=1e-6
    )


def test_temperature_divides_logits_and_zero_is_argmax(monkeypatch):
    spy = MultinomialSpy(monkeypatch)
    logits = torch.tensor([[1.0, 3.0, -2.0, 2.5], [0.0, -1.0, 4.0, 4.5]])
    sample_next(logits, SamplingParams(temperature=0.5), None)
    torch.testing.assert_close(spy.probs[0], (logits / 0.5).softmax(-1), rtol=0, atol=1e-6)
    assert sample_next(logits, SamplingParams(temperature=0.0), None).tolist() == [1, 3]
    assert len(spy.probs) == 1  # greedy does not sample


def test_top_k_and_top_p_draws_stay_inside_the_kept_set():
    """Many draws: only kept tokens ever appear, each about as often as its renormalised mass."""
    logits = torch.tensor([PROBS]).log().expand(20000, -1)
    draws = sample_next(
        logits, SamplingParams(temperature=1.0, top_k=4, top_p=0.75), torch.Generator().manual_seed(0)
    )
    counts = torch.bincount(draws, minlength=5).double() / draws.numel()
    expected = torch.tensor([0.0, 0.4, 0.0, 0.3, 0.15], dtype=torch.float64) / 0.85
    assert counts[0] == 0 and counts[2] == 0
    torch.testing.assert_close(counts, expected, rtol=0, atol=0.015)  # ~5 standard errors


@pytest.mark.parametrize("share_prompt_prefill", [True, False])
def test_on_group_done_reports_each_group_once_as_soon_as_its_samples_end(
    model_and_tokenizer, prompts, alone, share_prompt_prefill
):
    """Group 0 stops after a few tokens (a stop string from its own greedy text), the others
    run to max_new_tokens: group 0 is reported first, while the others still decode, and every
    report equals the final output of that group."""
    model, tokenizer = model_and_tokenizer
    stop = tokenizer.decode(alone[0])[2:4]
    engine = HFEngine(model, tokenizer, share_prompt_prefill=share_prompt_prefill)
    sampling = SamplingParams(max_new_tokens=GREEDY.max_new_tokens, temperature=0.0, stop=[stop])
    reports = []
    decode_calls = []
    hook = model.register_forward_pre_hook(lambda m, args, kw: decode_calls.append(1), with_kwargs=True)

    def on_group_done(group, generations):
        reports.append((group, generations, len(decode_calls)))

    try:
        out = engine.generate(prompts, 2, sampling, on_group_done=on_group_done)
    finally:
        hook.remove()
    assert sorted(g for g, _, _ in reports) == list(range(len(prompts)))  # each group exactly once
    first_group, first_generations, calls_then = reports[0]
    assert first_group == 0 and all(g.finish_reason == "stop" for g in first_generations)
    assert calls_then < len(decode_calls)  # reported while the other groups kept decoding
    for group, generations, _ in reports:
        assert generations == out[2 * group : 2 * group + 2]


def _random_kv(batch, length, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 2, length, 4, generator=g), torch.randn(batch, 2, length, 4, generator=g)


def test_roomy_cache_layer_matches_concatenation_through_growth_selection_and_cropping():
    from transformers.cache_utils import DynamicLayer

    from grouprl.rollout.engines.hf import _RoomyLayer

    keys, values = _random_kv(3, 5, seed=0)
    plain = DynamicLayer()
    plain.update(keys, values)
    roomy = _RoomyLayer(keys, values, room=2)
    for step in range(6):  # 6 single tokens into room for 2: it has to move twice
        k, v = _random_kv(3 if step < 3 else 2, 1, seed=step + 1)
        if step == 3:  # a row leaves the batch
            keep = torch.tensor([0, 2])
            plain.batch_select_indices(keep)
            roomy.batch_select_indices(keep)
        got_k, got_v = roomy.update(k, v)
        want_k, want_v = plain.update(k, v)
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
        assert roomy.get_seq_length() == plain.get_seq_length() == 6 + step
    roomy.batch_repeat_interleave(2)
    plain.batch_repeat_interleave(2)
    roomy.crop(-3)
    plain.crop(-3)
    assert torch.equal(roomy.keys, plain.keys) and torch.equal(roomy.values, plain.values)
    assert roomy.get_seq_length() == 8
    with pytest.raises(ValueError):
        roomy.crop(2)


def test_reserve_room_converts_full_attention_layers_only():
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    from grouprl.rollout.engines.hf import _reserve_room, _RoomyLayer

    cache = DynamicCache()
    cache.layers = [DynamicLayer(), DynamicSlidingWindowLayer(sliding_window=4), DynamicLayer()]
    for layer in cache.layers[:2]:
        layer.update(*_random_kv(2, 3, seed=0))
    _reserve_room(cache, 10)
    assert type(cache.layers[0]) is _RoomyLayer and cache.layers[0].get_seq_length() == 3
    assert type(cache.layers[1]) is DynamicSlidingWindowLayer  # its own update logic stays
    assert type(cache.layers[2]) is DynamicLayer  # empty: nothing to hold yet


def test_the_config_builds_the_engine_and_both_session_kinds_continue_alike(model_and_tokenizer, prompts):
    """`build_engine` gives the hf engine with the rollout settings; a session with KV reuse and
    one that re-feeds whole conversations give the same greedy turns."""
    from grouprl.config import RolloutConfig
    from grouprl.rollout.engines import ReprefillSession, build_engine
    from grouprl.rollout.engines.hf_session import KVSession

    model, tokenizer = model_and_tokenizer
    engine = build_engine(RolloutConfig(share_prompt_prefill=False, gen_batch_size=6), model, tokenizer)
    assert isinstance(engine, HFEngine) and not engine.share_prompt_prefill and engine.max_batch == 6
    reuse, whole = engine.open_session(prompts[:2], 2), engine.open_session(prompts[:2], 2, reuse_cache=False)
    assert isinstance(reuse, KVSession) and isinstance(whole, ReprefillSession)
    params = SamplingParams(max_new_tokens=4, temperature=0.0)
    turns = []
    for session in (reuse, whole):
        first = session.generate([0, 1, 2, 3], [[], [], [], []], params)
        second = session.generate([1, 3], [[5, 6], [7]], params)
        turns.append(([g.token_ids for g in first], [g.token_ids for g in second]))
    assert turns[0] == turns[1]


def test_a_decode_step_copies_to_the_host_as_often_for_many_rows_as_for_one(model_and_tokenizer, monkeypatch):
    """On a GPU each copy of a device tensor's value to the host waits for the device: the decode
    loop takes the active rows and the sampled tokens once a step, not a value per row."""
    model, tokenizer = model_and_tokenizer
    engine = HFEngine(model, tokenizer, report_log_probs=True)
    copies = {"n": 0}
    for name in ("__int__", "__index__", "item", "tolist"):
        real = getattr(torch.Tensor, name)

        def counted(self, *args, _real=real, **kwargs):
            copies["n"] += 1
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    counts = {}
    for rows in (1, 8):
        for steps in (6, 12):
            copies["n"] = 0
            params = SamplingParams(max_new_tokens=steps, temperature=1.0)
            out = engine.generate(random_prompts([4] * rows, len(tokenizer), seed=2), 1, params, RowStreams(0, range(rows)))
            assert all(len(g.token_ids) == steps for g in out)  # every row decodes every step
            counts[rows, steps] = copies["n"]
    per_step = {rows: (counts[rows, 12] - counts[rows, 6]) / 6 for rows in (1, 8)}
    assert per_step[8] == per_step[1] <= 3


def test_ignore_eos_samples_to_the_length_limit(model_and_tokenizer):
    """rollout.ignore_eos (measurements at fixed lengths): EOS is sampled as any token and the
    row goes on to max_new_tokens; without it the same draws end at the first EOS."""
    import copy

    model, tokenizer = model_and_tokenizer
    eager = copy.deepcopy(model)

    def likely_eos(module, args, out):  # EOS (id 1) the likeliest token at every step
        out = out.clone()
        out[..., 1] = out.max(-1).values + 3
        return out

    eager.lm_head.register_forward_hook(likely_eos)
    engine = HFEngine(eager, tokenizer)
    prompts = random_prompts([3, 5], len(tokenizer), seed=3)
    stopping = engine.generate(prompts, 2, SamplingParams(max_new_tokens=8), RowStreams(0, range(4)))
    going = engine.generate(prompts, 2, SamplingParams(max_new_tokens=8, ignore_eos=True), RowStreams(0, range(4)))
    assert sum(g.finish_reason == "eos" and len(g.token_ids) < 8 for g in stopping) >= 3
    assert all(g.finish_reason == "length" and len(g.token_ids) == 8 for g in going)
    for short, long in zip(stopping, going):  # the same draws up to the first EOS
        assert long.token_ids[: len(short.token_ids)] == short.token_ids
    assert sum(long.token_ids.count(1) for long in going) > len(going)  # EOS sampled, often, and passed
