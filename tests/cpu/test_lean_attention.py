"""lean_attention: grouped-query attention on the unrepeated keys/values gives transformers'
numbers and gradients, keeps the keys, values and mask once, and switches back after the block."""

import pytest
import torch

from grouprl.cpu.lean_attention import lean_attention
from grouprl.trainer.logprobs import ResponseBatch, response_log_probs
from helpers import exact_float64_norms, random_prompts, saved_activation_bytes, tiny_model_and_tokenizer


def _model(**overrides):
    model = tiny_model_and_tokenizer(dtype=torch.float64, seed=1, **overrides)[0]
    assert model.config._attn_implementation == "sdpa"
    return exact_float64_norms(model).train()


def _batch(model):
    vocab = model.config.vocab_size
    prompts = random_prompts([7, 7, 7, 4, 4, 4], vocab, seed=2)
    prompts[1] = prompts[2] = prompts[0]  # two groups of three
    prompts[4] = prompts[5] = prompts[3]
    ids = torch.randint(3, vocab, (6, 5), generator=torch.Generator().manual_seed(3))
    lengths = torch.tensor([5, 2, 4, 1, 5, 3])
    return ResponseBatch(prompts, ids, (torch.arange(5)[None] < lengths[:, None]).long())


def _log_probs_and_grads(model, batch, lean: bool, shared_prefix: bool):
    params = [p for p in model.parameters() if p.requires_grad]
    with lean_attention(model, enabled=lean) as switched:
        lp, _ = response_log_probs(model, batch, shared_prefix=shared_prefix)
        weights = torch.randn(lp.shape, generator=torch.Generator().manual_seed(4), dtype=lp.dtype)
        grads = torch.autograd.grad((lp * weights).sum(), params)
    return switched, lp.detach(), grads


@pytest.mark.parametrize("shared_prefix", [True, False])
def test_log_probs_and_gradients_equal_transformers_sdpa(shared_prefix):
    # shared prefix: left-padded prompts, then packed responses under a 4D mask; full sequences:
    # right-padded rows under a padding mask. Both attend with grouped heads (4 query, 2 kv).
    model = _model()
    batch = _batch(model)
    switched, lp, grads = _log_probs_and_grads(model, batch, lean=True, shared_prefix=shared_prefix)
    assert switched == 1
    assert model.config._attn_implementation == "sdpa"  # back after the block
    none, ref_lp, ref_grads = _log_probs_and_grads(model, batch, lean=False, shared_prefix=shared_prefix)
    assert none == 0
    torch.testing.assert_close(lp, ref_lp, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_keys_values_and_mask_are_kept_once():
    model = _model()
    cfg = model.config
    batch, length = 3, 8
    ids = torch.randint(3, cfg.vocab_size, (batch, length), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[0, :3] = 0  # left padding: transformers then builds a [B, 1, T, T] boolean mask

    def saved_bytes(lean: bool) -> int:
        run = lambda: model(input_ids=ids, attention_mask=mask)  # noqa: E731
        return saved_activation_bytes(model, run, lean_attention(model, enabled=lean))

    head_dim = cfg.hidden_size // cfg.num_attention_heads
    layers, extra_heads = cfg.num_hidden_layers, cfg.num_attention_heads - cfg.num_key_value_heads
    repeated = layers * 2 * extra_heads * batch * length * head_dim * 8  # keys and values, float64
    masks = (layers - 1) * batch * length * length * 8  # a float mask per layer -> one
    assert saved_bytes(False) - saved_bytes(True) == repeated + masks


def test_switch_is_undone_on_error_and_skips_other_attention_kinds():
    model = _model()
    with pytest.raises(RuntimeError, match="boom"):
        with lean_attention(model) as switched:
            assert switched == 1 and model.config._attn_implementation == "grouprl_sdpa"
            raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"
    model.config._attn_implementation = "eager"
    with lean_attention(model) as switched:
        assert switched == 0 and model.config._attn_implementation == "eager"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_converts_the_mask_once_and_changes_no_bit(dtype):
    """A decode step over a left-padded cache: the mask in SDPA's float form once a pass gives
    the very logits of transformers' sdpa path, which converts it in every layer."""
    import contextlib

    from torch.profiler import ProfilerActivity, profile
    from transformers import DynamicCache

    from grouprl.cpu.lean_attention import decode_attention

    model = tiny_model_and_tokenizer(dtype=dtype, seed=1)[0].eval()
    vocab, layers = model.config.vocab_size, model.config.num_hidden_layers
    ids = torch.randint(3, vocab, (3, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[0, :4] = mask[2, :1] = 0
    full = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], dim=1)
    positions = mask.sum(-1, keepdim=True)

    def step(decode: bool):
        cache = DynamicCache()
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
            switch = decode_attention(model) if decode else contextlib.nullcontext(0)
            with switch as switched, profile(activities=[ProfilerActivity.CPU]) as prof:
                logits = model(
                    input_ids=ids[:, :1], attention_mask=full, position_ids=positions, past_key_values=cache
                ).logits
        wheres = sum(e.count for e in prof.key_averages() if e.key == "aten::where")
        return switched, logits, wheres

    switched, logits, wheres = step(True)
    none, plain, plain_wheres = step(False)
    assert switched == 1 and none == 0 and model.config._attn_implementation == "sdpa"
    assert torch.equal(logits, plain)
    assert (plain_wheres, wheres) == (2 * layers, 0)  # torch's two in every layer; a fill once a pass
