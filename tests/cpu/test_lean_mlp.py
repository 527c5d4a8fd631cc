"""lean_mlp: the gated MLPs' numbers and gradients are the module's own, two [tokens, intermediate]
tensors per layer fewer are kept for backward, and nothing else changes."""

import pytest
import torch

from grouprl.cpu.lean_mlp import lean_mlp
from helpers import (
    exact_float64_norms,
    saved_activation_bytes,
    tiny_model_and_tokenizer,
    weighted_loss_and_grads,
)

TOKENS = (3, 9)  # batch x length of the input


def _model(arch="llama", seed=0, **overrides):
    model = tiny_model_and_tokenizer(dtype=torch.float64, seed=seed, arch=arch, **overrides)[0]
    return exact_float64_norms(model).train()


def _loss_and_grads(model, ids, lean: bool):
    return weighted_loss_and_grads(model, ids, lean_mlp(model, enabled=lean))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("mlp_bias", [False, True])
def test_values_and_gradients_equal_the_modules_own(arch, mlp_bias):
    overrides = {"mlp_bias": mlp_bias} if arch == "llama" else {}
    model = _model(arch, **overrides)
    ids = torch.randint(0, model.config.vocab_size, TOKENS, generator=torch.Generator().manual_seed(0))
    patched, loss, grads = _loss_and_grads(model, ids, lean=True)
    assert patched == model.config.num_hidden_layers
    none, ref_loss, ref_grads = _loss_and_grads(model, ids, lean=False)
    assert none == 0
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert all("forward" not in m.__dict__ for m in model.modules() if hasattr(m, "gate_proj"))  # restored


def test_two_intermediate_tensors_per_layer_fewer_are_saved():
    model = _model()
    ids = torch.randint(0, model.config.vocab_size, TOKENS, generator=torch.Generator().manual_seed(0))

    def saved_bytes(lean: bool) -> int:
        return saved_activation_bytes(model, lambda: model(input_ids=ids), lean_mlp(model, enabled=lean))

    cfg = model.config
    per_layer = 2 * TOKENS[0] * TOKENS[1] * cfg.intermediate_size * 8  # act(gate) and the product, float64
    assert saved_bytes(False) - saved_bytes(True) == cfg.num_hidden_layers * per_layer


def test_a_lora_down_projection_keeps_its_own_forward_and_gradients_match():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(
        _model(seed=2),
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=["down_proj", "up_proj"], init_lora_weights=False),
    )
    ids = torch.randint(0, model.config.vocab_size, TOKENS, generator=torch.Generator().manual_seed(0))
    patched, loss, grads = _loss_and_grads(model, ids, lean=True)
    assert patched == 2
    _, ref_loss, ref_grads = _loss_and_grads(model, ids, lean=False)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
    assert len(grads) == 4 * 2  # A and B of two targets in two layers: only adapters train
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_bf16_autocast_gradients_match_autograd():
    model = tiny_model_and_tokenizer(dtype=torch.float32, seed=0)[0].train()
    ids = torch.randint(0, model.config.vocab_size, TOKENS, generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss, grads = _loss_and_grads(model, ids, lean=True)
        _, ref_loss, ref_grads = _loss_and_grads(model, ids, lean=False)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    for got, want in zip(grads, ref_grads):
        assert got.dtype == want.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))


def test_other_modules_and_no_grad_calls_are_untouched():
    class OtherMLP(torch.nn.Module):  # same attributes, different forward: not taken
        def __init__(self):
            super().__init__()
            self.gate_proj = self.up_proj = self.down_proj = torch.nn.Linear(4, 4)
            self.act_fn = torch.nn.SiLU()

        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) + self.up_proj(x))

    model = _model()
    model.add_module("other", OtherMLP())
    with lean_mlp(model) as patched:
        assert "forward" not in model.other.__dict__
        assert patched == model.config.num_hidden_layers
        with torch.no_grad():
            ids = torch.randint(0, model.config.vocab_size, TOKENS, generator=torch.Generator().manual_seed(0))
            lean = model(input_ids=ids).logits
    with torch.no_grad():
        torch.testing.assert_close(lean, model(input_ids=ids).logits, rtol=0, atol=0)
