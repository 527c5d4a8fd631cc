"""lean_norm: RMSNorm values and gradients are those of autograd through the module's formula,
one [tokens, hidden] tensor per norm fewer is kept for backward, and nothing else changes."""

import copy

import pytest
import torch

from grouprl.cpu.lean_norm import lean_norm
from helpers import (
    exact_float64_norms,
    saved_activation_bytes,
    tiny_model_and_tokenizer,
    weighted_loss_and_grads,
)

TOKENS = (3, 9)  # batch x length of the input


def _ids(model, seed=0):
    return torch.randint(0, model.config.vocab_size, TOKENS, generator=torch.Generator().manual_seed(seed))


def _loss_and_grads(model, ids, lean: bool):
    return weighted_loss_and_grads(model, ids, lean_norm(model, enabled=lean))


def _norm_count(model) -> int:
    return 2 * model.config.num_hidden_layers + 1  # two per layer and the final one


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_float64_values_and_gradients_equal_autograd_through_the_same_formula(arch):
    # float64 stays float64 in the lean norm; the reference is the module's formula in float64
    # under autograd (transformers' own rounds to float32), so the comparison is exact to ~1e-12
    model = tiny_model_and_tokenizer(dtype=torch.float64, seed=3, arch=arch)[0].train()
    with torch.no_grad():  # norms away from 1, so their weight gradients matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=torch.Generator().manual_seed(len(name)), dtype=p.dtype) + 0.5)
    reference = exact_float64_norms(copy.deepcopy(model))
    patched, loss, grads = _loss_and_grads(model, _ids(model), lean=True)
    assert patched == _norm_count(model)
    _, ref_loss, ref_grads = _loss_and_grads(reference, _ids(model), lean=False)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert all("forward" not in m.__dict__ for m in model.modules())  # restored


def test_float32_values_and_gradients_equal_the_modules_own():
    model = tiny_model_and_tokenizer(dtype=torch.float32, seed=0)[0].train()
    _, loss, grads = _loss_and_grads(model, _ids(model), lean=True)
    none, ref_loss, ref_grads = _loss_and_grads(model, _ids(model), lean=False)
    assert none == 0
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_bf16_autocast_and_bf16_weights_match_autograd():
    model = tiny_model_and_tokenizer(dtype=torch.float32, seed=0)[0].train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss, grads = _loss_and_grads(model, _ids(model), lean=True)
        _, ref_loss, ref_grads = _loss_and_grads(model, _ids(model), lean=False)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    for got, want in zip(grads, ref_grads):
        assert got.dtype == want.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))
    bf16 = tiny_model_and_tokenizer(dtype=torch.bfloat16, seed=0)[0].train()  # casts to float32 and back
    _, loss, grads = _loss_and_grads(bf16, _ids(bf16), lean=True)
    _, ref_loss, ref_grads = _loss_and_grads(bf16, _ids(bf16), lean=False)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-2, atol=0)
    for got, want in zip(grads, ref_grads):
        assert got.dtype == want.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want.float(), rtol=5e-2, atol=5e-2 * float(want.abs().max()))


def test_one_hidden_sized_tensor_per_norm_fewer_is_saved():
    model = tiny_model_and_tokenizer(dtype=torch.float32, seed=0)[0].train()
    ids = _ids(model)

    def saved_bytes(lean: bool) -> int:
        return saved_activation_bytes(model, lambda: model(input_ids=ids), lean_norm(model, enabled=lean))

    per_norm = TOKENS[0] * TOKENS[1] * model.config.hidden_size * 4  # the normalised input, float32
    assert saved_bytes(False) - saved_bytes(True) == _norm_count(model) * per_norm


def test_frozen_norm_weights_get_no_gradient_and_other_norms_are_untouched():
    class ScaledNorm(torch.nn.Module):  # same attributes, different forward: not taken
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(4))
            self.variance_epsilon = 1e-6

        def forward(self, hidden_states):
            return (1.0 + self.weight) * hidden_states

    model = tiny_model_and_tokenizer(dtype=torch.float32, seed=0)[0].train()
    model.add_module("other", ScaledNorm())
    for name, p in model.named_parameters():
        p.requires_grad_("norm" not in name)
    with lean_norm(model) as patched:
        assert patched == _norm_count(model) and "forward" not in model.other.__dict__
        model(input_ids=_ids(model)).logits.sum().backward()
        with torch.no_grad():
            lean = model(input_ids=_ids(model)).logits
    assert all(p.grad is None for name, p in model.named_parameters() if "norm" in name)
    with torch.no_grad():
        torch.testing.assert_close(lean, model(input_ids=_ids(model)).logits, rtol=0, atol=0)
