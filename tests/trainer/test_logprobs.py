"""response_log_probs (full-sequence and shared-prefix paths) against log_softmax of the full
logits of model(prompt + response), row by row: values, entropy and parameter gradients.

One micro-batch mixes three groups with prompts of lengths 5, 9 and 1, in non-contiguous row
order, with responses of 1 to 6 tokens (padding in between).

The model is float64 and so are the log-probs (the LM head's output is only ever upcast), so
values agree to 1e-10 and gradients to rtol 1e-8. The models' RMSNorms are switched to float64
(helpers.exact_float64_norms): transformers computes them in float32, which alone limits
shared-prefix gradients to ~1e-7 relative (a prompt's gradient is summed over its rows before
the norm's float32 backward instead of after).
"""

import contextlib

import pytest
import torch

from grouprl.trainer.logprobs import (
    ResponseBatch,
    prefix_forward,
    response_log_probs,
    shared_opening,
    unique_prompts,
)
from helpers import exact_float64_norms, random_prompts, reference_log_probs, tiny_model_and_tokenizer

PROMPT_LENGTHS = [5, 9, 1]
# (group, response length) per row; groups interleaved, one 1-token response, one group of one
ROWS = [(0, 4), (1, 3), (0, 1), (2, 2), (1, 6), (0, 6)]
ATOL = 1e-10  # log-probs and entropies of magnitude ~5, in float64
GRAD_RTOL = 1e-8


def make_batch(vocab_size: int, seed: int = 0) -> ResponseBatch:
    prompts = random_prompts(PROMPT_LENGTHS, vocab_size, seed=seed)
    width = max(length for _, length in ROWS)
    gen = torch.Generator().manual_seed(seed + 1)
    response_ids = torch.randint(3, vocab_size, (len(ROWS), width), generator=gen)
    response_mask = torch.zeros(len(ROWS), width, dtype=torch.long)
    for i, (_, length) in enumerate(ROWS):
        response_mask[i, :length] = 1
        response_ids[i, length:] = 0  # pad
    return ResponseBatch([list(prompts[g]) for g, _ in ROWS], response_ids, response_mask)


def reference(model, batch: ResponseBatch, temperature: float = 1.0):
    return reference_log_probs(model, batch.prompt_ids, batch.response_ids, batch.response_mask, temperature)


def scalar_loss(log_probs, entropy, mask, seed=0):
    gen = torch.Generator().manual_seed(seed)
    weights = torch.randn(mask.shape, generator=gen, dtype=torch.float64)
    mask = mask.double()
    return (log_probs.double() * weights * mask).sum() + 0.3 * (entropy.double() * mask).sum()


def grads(model, loss):
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.autograd.grad(loss, params)


def assert_grads_close(actual, expected, rtol):
    for a, e in zip(actual, expected):
        scale = float(e.abs().max())
        torch.testing.assert_close(a.double(), e.double(), rtol=rtol, atol=rtol * scale)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request):
    model, _ = tiny_model_and_tokenizer(arch=request.param, dtype=torch.float64, seed=3)
    exact_float64_norms(model)
    if request.param == "qwen2":  # biases start at 0: make them matter
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0.0, 0.2, generator=torch.Generator().manual_seed(len(name)))
    return model


@pytest.fixture(scope="module")
def batch(model):
    return make_batch(model.config.vocab_size)


@pytest.mark.parametrize("shared_prefix", [True, False])
def test_values_and_entropy_match_full_logits(model, batch, shared_prefix):
    ref_lp, ref_ent = reference(model, batch)
    with torch.no_grad():
        lp, ent = response_log_probs(model, batch, shared_prefix=shared_prefix, with_entropy=True)
    assert lp.shape == ent.shape == batch.response_ids.shape
    torch.testing.assert_close(lp.double(), ref_lp, rtol=0, atol=ATOL)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=0, atol=ATOL)
    padding = ~batch.response_mask.bool()
    assert (lp[padding] == 0).all() and (ent[padding] == 0).all()
    assert (lp[~padding] < 0).all() and (ent[~padding] > 0).all()


@pytest.mark.parametrize("shared_prefix", [True, False])
def test_gradients_match_full_logits(model, batch, shared_prefix):
    mask = batch.response_mask
    expected = grads(model, scalar_loss(*reference(model, batch), mask))
    lp, ent = response_log_probs(model, batch, shared_prefix=shared_prefix, with_entropy=True, chunk_size=4)
    actual = grads(model, scalar_loss(lp, ent, mask))
    assert_grads_close(actual, expected, GRAD_RTOL)
    # the prompt's own positions get gradient through the (expanded) KV cache too
    assert all(float(g.abs().sum()) > 0 for g in actual)


def test_shared_prefix_equals_full_sequence_values_and_gradients(model, batch):
    mask = batch.response_mask
    out = {}
    for shared in (True, False):
        lp, ent = response_log_probs(model, batch, shared_prefix=shared, with_entropy=True)
        out[shared] = (lp.detach(), ent.detach(), grads(model, scalar_loss(lp, ent, mask, seed=5)))
    torch.testing.assert_close(out[True][0], out[False][0], rtol=0, atol=ATOL)
    torch.testing.assert_close(out[True][1], out[False][1], rtol=0, atol=ATOL)
    assert_grads_close(out[True][2], out[False][2], GRAD_RTOL)


@pytest.mark.parametrize("shared_prefix", [True, False])
def test_temperature_divides_logits(model, batch, shared_prefix):
    ref_lp, ref_ent = reference(model, batch, temperature=0.7)
    with torch.no_grad():
        lp, ent = response_log_probs(
            model, batch, shared_prefix=shared_prefix, temperature=0.7, with_entropy=True
        )
        plain, _ = response_log_probs(model, batch, shared_prefix=shared_prefix)
    torch.testing.assert_close(lp.double(), ref_lp, rtol=0, atol=ATOL)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=0, atol=ATOL)
    assert (lp - plain).abs().max() > 1e-2  # the temperature really changed something


def test_chunk_sizes_agree(model, batch):
    mask = batch.response_mask
    results = []
    for chunk_size in (1, 3, 1000):
        lp, ent = response_log_probs(
            model, batch, shared_prefix=True, with_entropy=True, chunk_size=chunk_size
        )
        results.append((lp.detach(), ent.detach(), grads(model, scalar_loss(lp, ent, mask, seed=2))))
    for lp, ent, g in results[1:]:
        torch.testing.assert_close(lp, results[0][0], rtol=0, atol=1e-12)
        torch.testing.assert_close(ent, results[0][1], rtol=0, atol=1e-12)
        assert_grads_close(g, results[0][2], 1e-10)


def test_row_order_does_not_matter(model, batch):
    """Rows permuted (groups made contiguous) give the same per-row numbers."""
    order = sorted(range(len(ROWS)), key=lambda i: ROWS[i][0])
    permuted = ResponseBatch(
        [batch.prompt_ids[i] for i in order], batch.response_ids[order], batch.response_mask[order]
    )
    with torch.no_grad():
        lp, ent = response_log_probs(model, batch, shared_prefix=True, with_entropy=True)
        lp_p, ent_p = response_log_probs(model, permuted, shared_prefix=True, with_entropy=True)
    torch.testing.assert_close(lp_p, lp[order], rtol=0, atol=1e-12)
    torch.testing.assert_close(ent_p, ent[order], rtol=0, atol=1e-12)


def test_without_entropy_gives_zero_entropy(model, batch):
    with torch.no_grad():
        lp, ent = response_log_probs(model, batch, shared_prefix=True, with_entropy=False)
        lp_e, _ = response_log_probs(model, batch, shared_prefix=True, with_entropy=True)
    assert (ent == 0).all()
    torch.testing.assert_close(lp, lp_e, rtol=0, atol=0)


def _count_layer_calls(model):
    """Forward calls of the layers' attention modules (a checkpointed backward replays each layer
    once more) and the input tokens of every decoder call."""
    counts = {"layer_calls": 0, "tokens": 0}
    decoder = model.get_decoder()

    def on_layer(module, args, kwargs):
        counts["layer_calls"] += 1

    def on_embed(module, args):
        counts["tokens"] += args[0].numel()

    for layer in decoder.layers:  # the checkpoint replays layer.forward, which calls self_attn
        layer.self_attn.register_forward_pre_hook(on_layer, with_kwargs=True)
    decoder.embed_tokens.register_forward_pre_hook(on_embed)
    return counts


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning")
@pytest.mark.parametrize("shared_prefix", [True, False])
def test_gradient_checkpointing_keeps_values_gradients_and_the_shared_prefix(batch, shared_prefix):
    model = exact_float64_norms(tiny_model_and_tokenizer(dtype=torch.float64, seed=3)[0])
    mask = batch.response_mask
    ref_lp, ref_ent = reference(model, batch)
    expected = grads(model, scalar_loss(ref_lp, ref_ent, mask))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()  # the tiny config has no dropout, so train mode changes nothing else
    counts = _count_layer_calls(model)
    lp, ent = response_log_probs(model, batch, shared_prefix=shared_prefix, with_entropy=True)
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=ATOL)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=ATOL)
    forward_calls = counts["layer_calls"]
    assert_grads_close(grads(model, scalar_loss(lp, ent, mask)), expected, GRAD_RTOL)
    n_layers = len(model.get_decoder().layers)
    passes = 2 if shared_prefix else 1  # prefix pass + response pass
    assert forward_calls == passes * n_layers
    assert counts["layer_calls"] == 2 * passes * n_layers  # every layer replayed in backward
    if shared_prefix:  # each distinct prompt ran once (left-padded to the longest), then its
        # responses packed end to end in one row: 4+1+6, 3+6 and 2 tokens, padded to 11
        assert counts["tokens"] == len(PROMPT_LENGTHS) * max(PROMPT_LENGTHS) + 3 * 11
    else:
        assert counts["tokens"] == len(ROWS) * max(max(PROMPT_LENGTHS) + n for _, n in ROWS)


def test_prefix_reused_by_several_micro_batches_gives_the_single_pass_gradient(model, batch):
    """One prefix pass, its leaves fed to two micro-batches that each backpropagate, then one
    prefix backward: the same parameter gradient as all rows in one pass."""
    mask = batch.response_mask
    params = [p for p in model.parameters() if p.requires_grad]
    lp, ent = response_log_probs(model, batch, shared_prefix=True, with_entropy=True)
    expected = grads(model, scalar_loss(lp, ent, mask, seed=4))
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)

    prompts, index = unique_prompts(batch.prompt_ids)
    model.zero_grad(set_to_none=True)
    prefix = prefix_forward(model, prompts)
    leaves = prefix.detached()
    for rows in ([0, 3, 4], [1, 2, 5]):
        sub = ResponseBatch([batch.prompt_ids[i] for i in rows], batch.response_ids[rows], mask[rows])
        lp, ent = response_log_probs(
            model, sub, with_entropy=True, prefix=leaves, prefix_index=[index[i] for i in rows]
        )
        m = mask[rows].double()
        ((lp * weights[rows] * m).sum() + 0.3 * (ent * m).sum()).backward()
    prefix.backward_from(leaves)
    assert_grads_close([p.grad for p in params], expected, GRAD_RTOL)
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("shared_prefix", [True, False])
def test_float64_model_gives_float64_accuracy(model, batch, shared_prefix):
    mask = batch.response_mask
    ref_lp, ref_ent = reference(model, batch)
    expected = grads(model, scalar_loss(ref_lp, ref_ent, mask))
    lp, ent = response_log_probs(model, batch, shared_prefix=shared_prefix, with_entropy=True, chunk_size=3)
    assert lp.dtype == torch.float64
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-10)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-10)
    assert_grads_close(grads(model, scalar_loss(lp, ent, mask)), expected, 1e-8)


def test_lora_shared_prefix_equals_full_sequences(batch):
    """Through a peft wrapper: same values, and the adapters' gradients flow through the prefix."""
    from peft import LoraConfig, get_peft_model

    base = exact_float64_norms(tiny_model_and_tokenizer(dtype=torch.float64, seed=3)[0])
    model = get_peft_model(
        base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    )
    with torch.no_grad():  # B starts at zero: make the adapters change the outputs
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    mask = batch.response_mask
    out = {}
    for shared in (True, False):
        lp, ent = response_log_probs(model, batch, shared_prefix=shared, with_entropy=True)
        out[shared] = (lp.detach(), grads(model, scalar_loss(lp, ent, mask, seed=7)))
    torch.testing.assert_close(out[True][0], out[False][0], rtol=0, atol=ATOL)
    assert_grads_close(out[True][1], out[False][1], GRAD_RTOL)
    assert len(out[True][1]) == 2 * 2 * 2  # lora_A and lora_B of q and v in 2 layers: only adapters train


def test_pack_fills_bins_of_one_prompt_first_fit_decreasing():
    from grouprl.trainer.logprobs import _pack

    lengths = [n for _, n in ROWS]  # 4 3 1 2 6 6
    prefix_of_row = [g for g, _ in ROWS]  # 0 1 0 2 1 0
    assert _pack(lengths, prefix_of_row, 11) == [(1, [4, 1]), (0, [5, 0, 2]), (2, [3])]
    # capacity 6: the 6-token responses fill a bin each; 4 and 1 share one; 3 and 2 are alone
    assert _pack(lengths, prefix_of_row, 6) == [(1, [4]), (0, [5]), (0, [0, 2]), (1, [1]), (2, [3])]
    assert _pack([], [], 6) == []
    assert _pack(lengths, prefix_of_row, 0) == [(g, [i]) for i, g in enumerate(prefix_of_row)]  # unpacked


def test_responses_split_over_several_packed_rows_match_full_logits(model, batch, monkeypatch):
    """A prompt's responses that do not fit one packed row go to several; values and gradients
    are those of the full-sequence reference all the same (and with 1-token packed rows)."""
    from grouprl.trainer import logprobs

    mask = batch.response_mask
    ref_lp, ref_ent = reference(model, batch)
    expected = grads(model, scalar_loss(ref_lp, ref_ent, mask))
    for capacity in (6, 8, 0):  # 6: the longest alone in a row; 8: bins of mixed fill; 0: unpacked
        monkeypatch.setattr(logprobs, "PACK_TOKENS", capacity)
        lp, ent = response_log_probs(model, batch, shared_prefix=True, with_entropy=True, chunk_size=5)
        torch.testing.assert_close(lp, ref_lp, rtol=0, atol=ATOL)
        torch.testing.assert_close(ent, ref_ent, rtol=0, atol=ATOL)
        assert_grads_close(grads(model, scalar_loss(lp, ent, mask)), expected, GRAD_RTOL)


def test_linear_head_backward_is_the_hand_written_one(model, batch, monkeypatch):
    """The values and gradients above come from the hand-written head backward (not a fallback),
    and with a frozen head it computes no weight gradient."""
    from grouprl.trainer import head_stats

    calls = []
    real = head_stats._LinearHeadStats.backward

    def spy(ctx, *grads):
        calls.append(ctx.needs_input_grad[:2])
        return real(ctx, *grads)

    monkeypatch.setattr(head_stats._LinearHeadStats, "backward", staticmethod(spy))
    lp, ent = response_log_probs(model, batch, shared_prefix=True, with_entropy=True, chunk_size=4)
    scalar_loss(lp, ent, batch.response_mask).backward()
    assert calls == [(True, True)]
    head = model.get_output_embeddings()
    model.zero_grad()
    head.weight.requires_grad_(False)
    try:
        lp, ent = response_log_probs(model, batch, shared_prefix=True, with_entropy=True, chunk_size=4)
        scalar_loss(lp, ent, batch.response_mask).backward()
    finally:
        head.weight.requires_grad_(True)
    assert calls[1] == (True, False) and head.weight.grad is None


def test_head_gradient_added_into_the_parameter_equals_autograds(model, batch):
    from grouprl.trainer.head_stats import head_grad_into_param

    weights = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)

    def grads(into_param: bool, hook: bool = False):
        model.zero_grad(set_to_none=True)
        head = model.get_output_embeddings().weight
        handle = head.register_hook(lambda g: g) if hook else None
        with head_grad_into_param() if into_param else contextlib.nullcontext():
            for seed in (0, 1):  # two accumulating backward calls, as micro-batches do
                lp, _ = response_log_probs(model, batch, shared_prefix=True, with_entropy=True)
                (lp * weights * (seed + 1)).sum().backward()
        if handle is not None:
            handle.remove()
        return [p.grad.clone() for p in model.parameters()]

    expected = grads(False)
    assert model.config.tie_word_embeddings  # the head's gradient meets the embedding's
    for got in (grads(True), grads(True, hook=True)):  # a hooked weight goes through autograd
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-14)
    model.zero_grad(set_to_none=True)


OPENING = 17  # tokens every prompt of `opened_batch` starts with


def opened_batch(vocab_size: int) -> ResponseBatch:
    """`make_batch`'s rows with one 17-token opening put in front of every prompt."""
    batch = make_batch(vocab_size)
    opening = random_prompts([OPENING], vocab_size, seed=9)[0]
    return ResponseBatch([list(opening) + p for p in batch.prompt_ids], batch.response_ids, batch.response_mask)


def test_shared_opening_is_the_longest_common_start_leaving_each_prompt_a_token():
    a, b, c = [1] * 20 + [2, 3], [1] * 20 + [4], [1] * 18 + [5, 6, 7]
    assert shared_opening([a, b, a]) == [1] * 20
    assert shared_opening([a, b, c]) == [1] * 18
    assert shared_opening([a, [1] * 20]) == [1] * 19  # the shorter prompt keeps its last token
    assert shared_opening([a, a]) == []  # one distinct prompt: its group's prefix already runs once
    assert shared_opening([a, [1] * 10 + [9] * 12]) == []  # 10 tokens: below the 16-token floor
    assert shared_opening([a, [1] * 10 + [9] * 12], min_tokens=10) == [1] * 10


def _opening_and_rows(model, batch):
    prompts, index = unique_prompts(batch.prompt_ids)
    tokens = shared_opening(prompts)
    assert len(tokens) == OPENING
    return prefix_forward(model, [tokens]), prompts, index


def test_prompts_run_on_a_shared_opening_equal_full_sequences(model):
    """The opening once, each prompt's rest on it, the responses on that: values and gradients
    equal to full sequences, the gradient flowing back through the opening."""
    batch = opened_batch(model.config.vocab_size)
    mask = batch.response_mask
    ref_lp, ref_ent = reference(model, batch)
    expected = grads(model, scalar_loss(ref_lp, ref_ent, mask))
    opening, _, _ = _opening_and_rows(model, batch)
    lp, ent = response_log_probs(model, batch, shared_prefix=True, with_entropy=True, opening=opening)
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=ATOL)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=ATOL)
    assert_grads_close(grads(model, scalar_loss(lp, ent, mask)), expected, GRAD_RTOL)


def test_opening_leaves_shared_by_micro_batches_give_the_single_pass_gradient(model):
    """The opening's leaves feed two micro-batches, each running its prompts' rest on them and
    backpropagating; then the opening's one backward: the gradient of all rows in one pass."""
    batch = opened_batch(model.config.vocab_size)
    mask = batch.response_mask
    params = [p for p in model.parameters() if p.requires_grad]
    ref_lp, ref_ent = reference(model, batch)
    expected = grads(model, scalar_loss(ref_lp, ref_ent, mask, seed=4))
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    model.zero_grad(set_to_none=True)
    opening, _, _ = _opening_and_rows(model, batch)
    opened = opening.detached()
    for rows in ([0, 3, 4], [1, 2, 5]):
        sub = ResponseBatch([batch.prompt_ids[i] for i in rows], batch.response_ids[rows], mask[rows])
        lp, ent = response_log_probs(model, sub, with_entropy=True, opening=opened)
        m = mask[rows].double()
        ((lp * weights[rows] * m).sum() + 0.3 * (ent * m).sum()).backward()
    assert opened.keys[0].grad is not None
    opening.backward_from(opened)
    assert_grads_close([p.grad for p in params], expected, GRAD_RTOL)
    model.zero_grad(set_to_none=True)


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning")
def test_shared_opening_under_gradient_checkpointing():
    model = exact_float64_norms(tiny_model_and_tokenizer(dtype=torch.float64, seed=3)[0])
    batch = opened_batch(model.config.vocab_size)
    mask = batch.response_mask
    ref_lp, ref_ent = reference(model, batch)
    expected = grads(model, scalar_loss(ref_lp, ref_ent, mask))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    counts = _count_layer_calls(model)
    opening, _, _ = _opening_and_rows(model, batch)
    lp, ent = response_log_probs(model, batch, shared_prefix=True, with_entropy=True, opening=opening)
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=ATOL)
    assert_grads_close(grads(model, scalar_loss(lp, ent, mask)), expected, GRAD_RTOL)
    n_layers = len(model.get_decoder().layers)
    # forward: opening, prompts' rest, responses; backward replays each
    assert counts["layer_calls"] == 2 * 3 * n_layers
    # the opening once; the rests (5, 9, 1 tokens) left-padded to 9; the packed responses as before
    assert counts["tokens"] == OPENING + len(PROMPT_LENGTHS) * max(PROMPT_LENGTHS) + 3 * 11


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning")
def test_a_flash_attention_model_runs_the_shared_prefix_through_sdpa(batch):
    """flash-attention's kernels take padding masks only; the shared-prefix path's packed
    responses need block masks. Stood in for by a kernel registered under a flash name that
    refuses a 4-D mask (as flash_attention_2 cannot read one): without `block_masks` the packed
    pass reaches it; inside, forward and the checkpointed backward run on sdpa with the exact
    values and gradients, and the model's own setting is back after."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import flash_attention_mask

    from grouprl.trainer.logprobs import block_masks

    seen = []

    def flash_like(module, query, key, value, attention_mask, **kwargs):
        seen.append(None if attention_mask is None else attention_mask.dim())
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError("a flash kernel takes padding masks only")
        return sdpa_attention_forward(module, query, key, value, None, **kwargs)  # values not checked

    AttentionInterface.register("flash_like", flash_like)
    AttentionMaskInterface.register("flash_like", flash_attention_mask)
    model = exact_float64_norms(tiny_model_and_tokenizer(dtype=torch.float64, seed=3)[0])
    mask = batch.response_mask
    ref_lp, ref_ent = reference(model, batch)
    expected = grads(model, scalar_loss(ref_lp, ref_ent, mask))
    model.config._attn_implementation_internal = "flash_like"
    with pytest.raises(ValueError, match="padding masks only"):
        response_log_probs(model, batch, shared_prefix=True)
    assert 4 in seen
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    seen.clear()
    with block_masks(model) as switched:
        lp, ent = response_log_probs(model, batch, shared_prefix=True, with_entropy=True)
        got = grads(model, scalar_loss(lp, ent, mask))  # checkpointed layers recompute in here
    assert switched == ["flash_like"] and seen == []
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=ATOL)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=ATOL)
    assert_grads_close(got, expected, GRAD_RTOL)
    assert model.config._attn_implementation == "flash_like"
    with block_masks(model, enabled=False) as switched:  # actor.shared_prefix=false: 2-D masks only
        assert switched == [] and model.config._attn_implementation == "flash_like"
