"""The decode-time linear layers: every call gives F.linear's numbers bitwise (trials return the
usual form's result, and another form is kept only where it matched it bitwise), the measured
choice is fixed after its trials, and nothing outside the `with` block (or with gradients on)
changes."""

import pytest
import torch
import torch.nn.functional as F

from grouprl.cpu import small_matmul
from grouprl.cpu.small_matmul import MAX_ROWS, SLICE, TRIALS, small_batch_linear


@pytest.fixture(autouse=True)
def fresh_choices(monkeypatch):
    monkeypatch.setattr(small_matmul, "_CHOICE", {})
    monkeypatch.setattr(small_matmul, "_TRIALS", {})


@pytest.fixture
def counted(monkeypatch):
    """Counts the calls of the transposed form."""
    calls = []
    original = small_matmul._transposed_product

    def spy(*args):
        calls.append(args[0].shape[0])
        return original(*args)

    monkeypatch.setattr(small_matmul, "_transposed_product", spy)
    return calls


def linear(bias=True, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Linear(24, 40, bias=bias, dtype=torch.float64)


@pytest.mark.parametrize("rows", [1, 3, 8, MAX_ROWS, MAX_ROWS + 1])
@pytest.mark.parametrize("bias", [True, False])
def test_every_call_equals_f_linear(rows, bias):
    layer = linear(bias)
    x = torch.randn(rows, 1, 24, dtype=torch.float64)
    want = F.linear(x, layer.weight, layer.bias)
    with torch.no_grad(), small_batch_linear(layer):
        for _ in range(2 * TRIALS + 3):  # the trials of both forms, then the chosen one
            got = layer(x)
            assert got.shape == (rows, 1, 40)
            assert got.is_contiguous()
            assert torch.equal(got, want)


def fake_forms(monkeypatch, usual_cost, transposed_cost, off_by_an_ulp=False):
    """A fake clock each form advances by its cost, and the calls in order; the transposed form
    returns the usual form's numbers, or those moved by one ulp."""
    clock, calls = [0.0], []

    def transposed(x2, weight, bias):
        clock[0] += transposed_cost
        calls.append("transposed")
        out = F.linear(x2, weight, bias)
        return torch.nextafter(out, torch.full_like(out, float("inf"))) if off_by_an_ulp else out

    def usual(*args):
        clock[0] += usual_cost
        calls.append("usual")
        return F.linear(*args)

    monkeypatch.setattr(small_matmul.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(small_matmul, "_transposed_product", transposed)
    monkeypatch.setattr(small_matmul, "F", type("F", (), {"linear": staticmethod(usual)}))
    return calls


@pytest.mark.parametrize("usual_cost, transposed_cost, transposed_wins", [(5, 1, True), (1, 5, False), (2, 2, False)])
def test_trials_take_both_forms_then_the_faster_is_fixed(monkeypatch, usual_cost, transposed_cost, transposed_wins):
    calls = fake_forms(monkeypatch, usual_cost, transposed_cost)
    layer, x = linear(), torch.randn(8, 24, dtype=torch.float64)
    with torch.no_grad(), small_batch_linear(layer):
        for _ in range(TRIALS):
            layer(x)
        assert calls == ["usual", "transposed", "transposed", "usual"] * (TRIALS // 2)
        key = ((40, 24), 8, torch.float64, None)
        assert small_matmul._CHOICE == {key: "transposed" if transposed_wins else "usual"}
        assert small_matmul._TRIALS == {}
        for _ in range(3):
            layer(x)
    assert calls[2 * TRIALS :] == ["transposed" if transposed_wins else "usual"] * 3


def test_a_faster_form_that_moves_a_number_by_one_ulp_is_never_kept(monkeypatch):
    calls = fake_forms(monkeypatch, usual_cost=5, transposed_cost=1, off_by_an_ulp=True)
    layer, x = linear(), torch.randn(8, 24, dtype=torch.float64)
    want = torch.nn.functional.linear(x, layer.weight, layer.bias)
    with torch.no_grad(), small_batch_linear(layer):
        outs = [layer(x) for _ in range(TRIALS + 3)]
    assert small_matmul._CHOICE == {((40, 24), 8, torch.float64, None): "usual"}
    assert calls[2 * TRIALS :] == ["usual"] * 3
    assert all(torch.equal(out, want) for out in outs)  # the trials returned the usual form's numbers


@pytest.mark.parametrize("sliced_matches", [True, False])
def test_a_head_of_many_outputs_also_tries_its_product_in_slices(monkeypatch, sliced_matches):
    """A weight of 4 slices or more has a third form, the usual product slice by slice: its
    numbers are the usual form's (real products), and it is kept when fastest and equal."""
    torch.manual_seed(1)
    head = torch.nn.Linear(24, 4 * SLICE + 7, bias=True, dtype=torch.float64)  # a last, short slice
    x = torch.randn(3, 24, dtype=torch.float64)
    want = F.linear(x, head.weight, head.bias)
    assert torch.equal(small_matmul._sliced_product(x, head.weight, head.bias), want)
    assert small_matmul._forms(head.weight) == ["usual", "transposed", "sliced"]
    assert small_matmul._forms(linear().weight) == ["usual", "transposed"]
    calls = fake_forms(monkeypatch, usual_cost=5, transposed_cost=3)

    def sliced(*args):  # free on the fake clock: the fastest
        calls.append("sliced")
        return want.clone() if sliced_matches else torch.nextafter(want, torch.full_like(want, float("inf")))

    monkeypatch.setattr(small_matmul, "_sliced_product", sliced)
    with torch.no_grad(), small_batch_linear(head):
        outs = [head(x) for _ in range(TRIALS + 2)]
    key = ((4 * SLICE + 7, 24), 3, torch.float64, None)
    assert small_matmul._CHOICE == {key: "sliced" if sliced_matches else "transposed"}
    assert all(torch.equal(out, want) for out in outs)


@pytest.mark.parametrize("transposed_wins", [True, False])
def test_the_recorded_choice_is_used(counted, transposed_wins):
    layer, x = linear(), torch.randn(5, 24, dtype=torch.float64)
    small_matmul._CHOICE[((40, 24), 5, torch.float64, None)] = "transposed" if transposed_wins else "usual"
    with torch.no_grad(), small_batch_linear(layer):
        for _ in range(4):
            layer(x)
    assert len(counted) == (4 if transposed_wins else 0)


def test_large_inputs_and_gradient_mode_take_f_linear(counted):
    layer = linear()
    small_matmul._CHOICE[((40, 24), MAX_ROWS + 1, torch.float64, None)] = "transposed"
    small_matmul._CHOICE[((40, 24), 4, torch.float64, None)] = "transposed"
    with small_batch_linear(layer):
        with torch.no_grad():
            layer(torch.randn(MAX_ROWS + 1, 24, dtype=torch.float64))
        out = layer(torch.randn(4, 24, dtype=torch.float64))  # grad on: training is never changed
    assert counted == []
    out.sum().backward()
    assert layer.weight.grad is not None


def test_usual_products_take_f_linear_untimed_and_end_with_their_block(counted):
    layer, x = linear(), torch.randn(5, 24, dtype=torch.float64)
    small_matmul._CHOICE[((40, 24), 5, torch.float64, None)] = "transposed"
    with torch.no_grad(), small_batch_linear(layer):
        with small_matmul.usual_products():
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=0, atol=0)
            layer(torch.randn(7, 24, dtype=torch.float64))  # a new row count: no trial either
        assert counted == [] and small_matmul._TRIALS == {}
        layer(x)
    assert counted == [5]


def test_patch_is_removed_after_the_block_even_on_error_and_subclasses_are_left_alone():
    class Custom(torch.nn.Linear):
        pass

    model = torch.nn.Sequential(linear(), torch.nn.ReLU(), Custom(40, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="inside"):
        with small_batch_linear(model):
            assert "forward" in model[0].__dict__
            assert "forward" not in model[2].__dict__
            with small_batch_linear(model):  # nested: the outer patch stays, nothing doubled
                pass
            assert "forward" in model[0].__dict__
            raise RuntimeError("inside")
    assert "forward" not in model[0].__dict__


def test_lora_base_layers_are_patched_and_the_lora_output_is_unchanged():
    peft = pytest.importorskip("peft")
    from helpers import tiny_model_and_tokenizer

    model, _ = tiny_model_and_tokenizer(dtype=torch.float64, seed=0)
    lora = peft.get_peft_model(
        model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    ids = torch.randint(0, model.config.vocab_size, (6, 1))
    with torch.no_grad():
        want = lora(input_ids=ids).logits
        small_matmul._CHOICE.update(
            {(tuple(m.weight.shape), 6, torch.float64, None): True for m in lora.modules() if type(m) is torch.nn.Linear}
        )
        with small_batch_linear(lora):
            patched = [m for m in lora.modules() if "forward" in m.__dict__]
            got = lora(input_ids=ids).logits
    assert any("base_layer" in name for name, m in lora.named_modules() if m in patched)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
