"""release_free_memory gives the pages of freed heap chunks back; mapped_large_blocks: inside the
block, large tensors that the heap has no room for are mmapped (and unmapped when freed), outside
it they grow the heap, and the setting is undone on leaving, also on an error. Both run in a
fresh interpreter, whose heap has no large free chunks yet."""

import subprocess
import sys
import textwrap

import pytest

from grouprl.cpu import allocator

MiB = 1 << 20

SCRIPT = textwrap.dedent(
    """
    import ctypes, torch
    from grouprl.cpu import allocator

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in
                    "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    mapped = lambda: libc.mallinfo2().hblkhd
    MiB = 1 << 20

    def mapped_by(nbytes):
        before = mapped()
        t = torch.ones(nbytes // 4)
        added = mapped() - before
        return t, added

    keep = []
    with allocator.mapped_large_blocks(1 * MiB) as ok:
        assert ok
        t, added = mapped_by(6 * MiB)
        assert added >= 6 * MiB, added
        before = mapped()
        del t
        assert mapped() == before - added, "unmapped on free"
        t, added = mapped_by(MiB // 2)
        assert added == 0, added  # below the threshold: heap
        keep.append(t)
    t, added = mapped_by(6 * MiB)
    assert added == 0, added  # back at the 32 MiB ceiling: the heap grows
    keep.append(t)
    try:
        with allocator.mapped_large_blocks(1 * MiB):
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    t, added = mapped_by(7 * MiB)
    assert added == 0, added  # undone after the error
    print("ok")
    """
)


TRIM_SCRIPT = textwrap.dedent(
    """
    import ctypes, os, torch
    from grouprl.cpu import allocator

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 32 << 20)  # blocks under 32 MiB from the heap
    libc.mallopt(-1, 1 << 30)  # no automatic trim of the heap's top when a block is freed
    rss = lambda: int(open(f"/proc/{os.getpid()}/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    blocks = [torch.ones(128 << 10) for _ in range(200)]  # 200 x 512 KiB, written
    pin = torch.ones(128 << 10)  # above them (no hole fits it): the freed blocks are not at the heap's top
    before = rss()
    del blocks
    kept = rss()
    assert kept > before - (20 << 20), (before, kept)  # freed, but still resident
    assert allocator.release_free_memory()
    after = rss()
    assert after < kept - (80 << 20), (kept, after)  # ~100 MiB handed back
    print("ok")
    """
)


def _run(script: str) -> None:
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.skipif(allocator._glibc() is None, reason="glibc only")
def test_free_heap_pages_are_given_back():
    _run(TRIM_SCRIPT)


@pytest.mark.slow
@pytest.mark.skipif(allocator._glibc() is None, reason="glibc only")
def test_large_blocks_are_mapped_and_given_back_inside_the_block_only():
    _run(SCRIPT)


def test_zero_leaves_malloc_alone_and_the_threshold_is_restored(monkeypatch):
    calls = []
    monkeypatch.setattr(allocator, "_mallopt", lambda: lambda *a: calls.append(a) or 1)
    with allocator.mapped_large_blocks(0) as ok:
        assert not ok
    assert calls == []
    with allocator.mapped_large_blocks(3 * MiB) as ok:
        assert ok
    assert calls == [(allocator.M_MMAP_THRESHOLD, 3 * MiB), (allocator.M_MMAP_THRESHOLD, allocator.GLIBC_CEILING)]


def test_without_glibc_both_do_nothing(monkeypatch):
    monkeypatch.setattr(allocator, "_glibc", lambda: None)
    with allocator.mapped_large_blocks(MiB) as ok:
        assert not ok
    assert not allocator.release_free_memory()


def _count_trims(monkeypatch) -> list[str]:
    calls = []
    monkeypatch.setattr(allocator, "release_free_memory", lambda: calls.append("trim") or True)
    return calls


def test_decoder_layers_are_found_through_a_peft_wrapper():
    peft = pytest.importorskip("peft")
    from helpers import tiny_model_and_tokenizer

    model, _ = tiny_model_and_tokenizer(num_hidden_layers=3)
    assert allocator.decoder_layers(model) == list(model.model.layers)
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    assert allocator.decoder_layers(wrapped) == list(model.model.layers)


@pytest.mark.parametrize(("every", "layers", "expected"), [(1, 4, 4), (2, 4, 2), (3, 4, 1), (5, 4, 0), (0, 4, 0)])
def test_backward_trims_at_every_nth_decoder_layer_and_leaves_gradients_alone(monkeypatch, every, layers, expected):
    import torch

    from helpers import tiny_model_and_tokenizer

    model, _ = tiny_model_and_tokenizer(num_hidden_layers=layers)
    monkeypatch.setattr(allocator, "_glibc", lambda: object())  # as on glibc, also elsewhere
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])

    def grads():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids).logits.log_softmax(-1)[..., 3].sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    plain = grads()
    calls = _count_trims(monkeypatch)
    with allocator.trim_during_backward(model, every) as hooked:
        assert hooked == expected
        with torch.no_grad():  # nothing to trim for: no backward follows
            model(input_ids=ids)
        assert calls == []
        trimmed = grads()
        assert calls == ["trim"] * expected  # during backward, not forward
    assert all(torch.equal(a, b) for a, b in zip(plain, trimmed, strict=True))
    calls.clear()
    grads()
    assert calls == []  # hooks removed on leaving


def test_without_glibc_backward_is_not_hooked(monkeypatch):
    from helpers import tiny_model_and_tokenizer

    model, _ = tiny_model_and_tokenizer(num_hidden_layers=2)
    monkeypatch.setattr(allocator, "_glibc", lambda: None)
    with allocator.trim_during_backward(model, 1) as hooked:
        assert hooked == 0


def test_layers_fsdp_gave_a_class_of_their_own_are_found_and_forward_trims_leave_outputs_alone(monkeypatch):
    """FSDP2 makes each sharded layer an instance of a class of its own deriving from the layer's
    (FSDPLlamaDecoderLayer): still a decoder layer. A forward trims after every n-th layer and
    returns what it would have returned."""
    import torch

    from helpers import tiny_model_and_tokenizer

    model, _ = tiny_model_and_tokenizer(num_hidden_layers=4)
    layers = list(model.model.layers)
    for layer in layers:  # as fully_shard does
        layer.__class__ = type(f"FSDP{type(layer).__name__}", (type(layer),), {})
    assert allocator.decoder_layers(model) == layers
    monkeypatch.setattr(allocator, "_glibc", lambda: object())
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        plain = model(input_ids=ids).logits
    calls = _count_trims(monkeypatch)
    with allocator.trim_during_forward(model, 2) as hooked, torch.no_grad():
        assert hooked == 2
        trimmed = model(input_ids=ids).logits
    assert calls == ["trim"] * 2 and torch.equal(plain, trimmed)
    with torch.no_grad():
        model(input_ids=ids)
    assert calls == ["trim"] * 2  # hooks removed on leaving


FSDP_SCRIPT = textwrap.dedent(
    """
    import traceback
    import torch, torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from grouprl.cpu import allocator

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    sizes = []
    plain_empty = allocator._mapped_empty
    def counted(size, **kw):
        sizes.append((traceback.extract_stack()[-3].name, tuple(size)))
        return plain_empty(size, **kw)
    allocator._mapped_empty = counted

    def model():
        torch.manual_seed(0)
        m = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(3)))
        for layer in m:
            fully_shard(layer)
        fully_shard(m)
        return m

    def grads(m):
        x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
        m(x).square().sum().backward()
        return [p.grad.full_tensor().clone() for p in m.parameters()]

    plain = grads(model())
    assert sizes == []
    m = model()
    with allocator.mapped_collective_buffers(m) as count:
        assert count == 4, count  # three layers and the root
        mapped = grads(m)
    # one rank gathers nothing (its shard is the whole); each layer's gradients are reduce-scattered
    # through an input and an output buffer of 64 x 64 + 64 elements
    assert sizes == [("foreach_reduce", (64 * 64 + 64,))] * 3 * 2, sizes
    assert all(torch.equal(a, b) for a, b in zip(plain, mapped, strict=True))
    before = len(sizes)
    grads(m)
    assert len(sizes) == before  # FSDP's own buffers again on leaving
    dist.destroy_process_group()
    print("ok")
    """
)


@pytest.mark.slow  # a fresh interpreter with a process group: ~4 s
def test_fsdp_collective_buffers_are_allocated_mapped_within_the_block_and_gradients_are_unchanged():
    """Each layer's reduce-scatter buffers go through the mapped allocation inside the block (a
    world of one rank: FSDP still copies its gradients in and out of them; the all-gather's, which
    one rank skips, take the same allocation, measured on 2 and 4 ranks in benchmarks/RESULTS.md)
    and the gradients are those of FSDP's own buffers; on leaving, FSDP allocates as before."""
    if allocator._glibc() is None:
        pytest.skip("glibc only")
    done = subprocess.run([sys.executable, "-c", FSDP_SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
