"""The memory plan (trainer/memory/): model shapes counted on the meta device against the built
models, its parts worked out by hand, the activation count against autograd's own saved tensors,
the dry run of the source's recipe for a Qwen2.5-VL-7B on 8 x 80 GB (fits) and 1 x 80 GB (refused,
with what would fit), a run refused before its model loads, and the measured peaks."""

import contextlib
import importlib.util
import json
import logging
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from tiny import tiny_model_dir, write_run_config
from transformers import AutoModelForCausalLM

import grouprl.trainer.setup as trainer_setup
from grouprl.cli import main
from grouprl.config import ModelConfig, load_config
from grouprl.errors import UserError
from grouprl.trainer.memory import (
    GIB,
    Devices,
    PeakMeter,
    Shape,
    activation_bytes_per_token,
    devices_for,
    lr_resolution_warning,
    model_shape,
    plan_memory,
    settle_for_devices,
    what_would_fit,
)
from grouprl.trainer.trainer import Trainer
from helpers import tiny_config, tiny_model_and_tokenizer
from vision_helpers import tiny_vlm

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
spec = importlib.util.spec_from_file_location("architectures", BENCHMARKS / "architectures.py")
architectures = sys.modules["architectures"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(architectures)
SOURCE = str(Path(__file__).resolve().parents[2] / "configs" / "source_phase2.yaml")


def counted(model) -> tuple[int, int]:
    unique = {id(p): p for p in model.parameters()}.values()
    return sum(p.numel() for p in unique), sum(p.numel() for p in unique if p.requires_grad)


# ------------------------------------------------------------------------- shapes
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_shape_counts_what_the_built_model_holds(arch):
    model, _ = tiny_model_and_tokenizer(arch=arch, tie_word_embeddings=False)
    shape = model_shape(ModelConfig(), model.config)
    assert (shape.params, shape.trainable) == counted(model)
    assert shape.layer == sum(p.numel() for p in model.model.layers[0].parameters())
    assert shape.linear == sum(m.weight.numel() for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear))
    assert (shape.layers, shape.hidden, shape.intermediate, shape.kv_heads, shape.head_dim) == (2, 32, 64, 2, 8)
    assert shape.head == model.lm_head.weight.numel()  # untied: a copy under autocast stores it in bf16 too
    tied, _ = tiny_model_and_tokenizer(arch=arch)
    assert model_shape(ModelConfig(), tied.config).head == 0


def test_lora_and_a_vlms_frozen_tower_count_as_they_train(tmp_path):
    """LoRA's trainable adapters and a VLM's frozen tower: the shape from the config alone is what
    the loader builds (peft on the real model, the family's frozen parts)."""
    from grouprl.trainer.models import load_causal_lm

    model_dir = tiny_model_dir(tmp_path / "text")
    cfg = replace(ModelConfig(path=str(model_dir)), lora=replace(ModelConfig().lora, rank=4))
    loaded = load_causal_lm(cfg, str(model_dir), torch.device("cpu"), torch.float32)
    shape = model_shape(cfg, loaded.config)
    assert (shape.params, shape.trainable) == counted(loaded) and shape.trainable < shape.params / 4

    vlm, _, _ = tiny_vlm("qwen2_5_vl", tmp_path / "vlm")
    cfg = ModelConfig(path=str(tmp_path / "vlm"))
    loaded = load_causal_lm(cfg, str(tmp_path / "vlm"), torch.device("cpu"), torch.float32)
    shape = model_shape(cfg, loaded.config)
    tower = sum(p.numel() for n, p in loaded.named_parameters() if n.startswith("model.visual."))
    assert (shape.params, shape.trainable, shape.vision) == (*counted(loaded), tower) and tower > 0
    assert shape.trainable == shape.params - tower  # the tower frozen (model.freeze_vision_tower)


def test_the_published_configs_count_their_published_sizes():
    sizes = {}
    for name, values in architectures.ARCHITECTURES.items():
        from transformers import AutoConfig

        config = AutoConfig.for_model(**values)
        sizes[name] = model_shape(ModelConfig(), config).params / 1e9
    # the model cards' sizes (SmolLM2: 135M; Qwen2.5: 0.49B, 1.54B, 3.09B, 7.62B; Qwen2.5-VL: 3.75B, 8.29B)
    assert sizes == pytest.approx(
        {"smollm2-135m": 0.135, "qwen2.5-0.5b": 0.494, "qwen2.5-1.5b": 1.544, "qwen2.5-3b": 3.086, "qwen2.5-7b": 7.616,
         "qwen2.5-vl-3b": 3.755, "qwen2.5-vl-7b": 8.292}, abs=0.01,
    )  # fmt: skip


# ------------------------------------------------------------------------- the parts
SHAPE = Shape(
    params=1_000_000_000, trainable=1_000_000_000, vision=0, linear=900_000_000, layer=30_000_000, layers=30,
    hidden=2048, intermediate=5504, heads=16, kv_heads=4, head_dim=128, vocab=100_000,
)  # fmt: skip


EIGHT_GPUS = Devices("cuda", 1, 8, 80.0)


def plan_for(*overrides, devices=EIGHT_GPUS, shape=SHAPE):
    return plan_memory(load_config(None, list(overrides)), shape, devices)


def test_start_up_by_hand():
    """Each of 8 GPUs reads its shard's slices of the checkpoint (0.5 GB of 1e9 float32 weights) a
    tensor at a time (the largest: an eighth of the 100,000 x 2048 embedding in flight); one GPU
    alone loads the whole model; both with the allocator's margin (5% of what PyTorch allocates).
    On a CPU the file's pages a rank reads are mapped into it while it reads them."""
    g = 1e9 / GIB
    parts = plan_for().phase("startup").parts
    slice_ = 100_000 * 2048 * 4 / 8 / GIB
    assert parts == pytest.approx({
        "runtime": 1.0, "policy shard": 4 * g / 8, "one tensor's slice in flight": slice_,
        "allocator margin (5%, fragmentation)": 0.05 * (4 * g / 8 + slice_),
    })  # fmt: skip
    alone = plan_for(devices=Devices("cuda", 1, 1, 80.0)).phase("startup").parts
    assert alone == pytest.approx({"runtime": 1.0, "policy": 4 * g, "allocator margin (5%, fragmentation)": 0.2 * g})
    two_cpu_ranks = plan_for(devices=Devices("cpu", 1, 2, 24.0)).phase("startup").parts
    # the slices are read by byte ranges into the shard (trainer/slices.py): no file pages stay mapped
    assert two_cpu_ranks == pytest.approx({"runtime": 1.0, "policy shard": 4 * g / 2, "one tensor's slice in flight": 100_000 * 2048 * 4 / 2 / GIB})


def test_the_reference_and_the_optimizer_state_in_host_memory_leave_generation():
    """With a KL reference on 8 GPUs: the reference (a policy shard's size) is off the device while
    the policy generates and through the update's own passes (it comes for its pass, before them:
    smaller than the update's peak here); AdamW's state is off the device while generating only.
    Every difference carries the allocator's 5% margin."""
    kl = ["actor.kl_loss_coef=0.01", "rollout.engine=vllm", "model.gradient_checkpointing=true"]
    kept = plan_for(*kl, "actor.reference_offload=false")
    parked = plan_for(*kl)  # auto on CUDA
    both = plan_for(*kl, "actor.optimizer_offload=true")
    g, m = 1e9 / GIB, 1.05
    gen = lambda p: p.phase("generation").parts  # noqa: E731
    upd = lambda p: p.phase("update").parts  # noqa: E731
    assert gen(kept)["reference"] == pytest.approx(4 * g / 8)
    assert gen(parked)["reference (in host memory)"] == 0 and "reference" not in gen(parked)
    assert parked.phase("generation").peak == pytest.approx(kept.phase("generation").peak - m * 4 * g / 8)
    assert upd(parked)["reference (its pass, beyond the update's own)"] == 0
    assert parked.phase("update").peak == pytest.approx(kept.phase("update").peak - m * 4 * g / 8)
    assert both.phase("generation").peak == pytest.approx(parked.phase("generation").peak - m * 8 * g / 8)
    assert "optimizer state" not in gen(both) and upd(both)["optimizer state"] == pytest.approx(8 * g / 8)
    assert both.phase("update").peak == pytest.approx(parked.phase("update").peak)
    assert (parked.resolved["reference"], both.resolved["optimizer state"]) == (
        "in host memory outside its pass", "in host memory outside the update"
    )
    # vLLM given nearly all of the device: what the trainer keeps beside it must leave
    tight = [*kl, "rollout.gpu_memory_utilization=0.975", "actor.reference_offload=false"]
    cfg = load_config(None, tight)
    assert not plan_memory(cfg, SHAPE, EIGHT_GPUS).fits
    fixes = what_would_fit(cfg, SHAPE, EIGHT_GPUS)
    assert "actor.optimizer_offload=true" in fixes and "actor.reference_offload=true" not in fixes  # 0.47 GiB is not enough
    assert plan_for(*tight, "actor.optimizer_offload=true").fits
    # without a KL term there is no reference to move; a CPU moves nothing
    assert "reference (in host memory)" not in gen(plan_for("rollout.engine=vllm"))
    cpu = plan_for("actor.kl_loss_coef=0.01", devices=Devices("cpu", 1, 1, 24.0))
    assert "reference" in gen(cpu) and "optimizer state" in gen(cpu)


def test_a_second_micro_batch_holds_the_prompt_pass_gradients_and_vllm_awake_stays():
    """One process: after the first micro-batch the responses' weight gradients wait in
    autograd's buffers for the prompts' pass, beside the gradients accumulated so far (the
    decoder's in bf16, the gradients of autocast's cached casts; the input embeddings' in
    float32, and a copy while the two passes' are summed); an engine that does not sleep keeps
    its share through the update."""
    rows = ["rollout.engine=vllm", "rollout.sleep_level=0", "actor.micro_batch_tokens=0"]
    one = plan_for(*rows, "actor.micro_batch_size=64", devices=Devices("cuda", 1, 1, 80.0))
    two = plan_for(*rows, "actor.micro_batch_size=4", devices=Devices("cuda", 1, 1, 80.0))
    assert "gradients waiting for the prompts' pass" not in one.phase("update").parts
    embeddings = 100_000 * 2048
    waiting = min(1e9 - embeddings, 30 * 30e6) * 2 + 2 * embeddings * 4
    assert two.phase("update").parts["gradients waiting for the prompts' pass"] == pytest.approx(waiting / GIB)
    assert two.phase("update").parts["engine (awake)"] == 0.5 * 80
    unshared = plan_for("actor.shared_prefix=false", "actor.micro_batch_size=4", "actor.micro_batch_tokens=0", devices=Devices("cuda", 1, 1, 80.0))
    assert "gradients waiting for the prompts' pass" not in unshared.phase("update").parts


def test_autocast_keeps_a_cast_of_the_weights_in_one_process():
    """bf16 autocast over float32 weights in one process: the casts of the linear weights live as
    long as the rollout's autocast (built-in engine) and, in the update, as long as backward needs
    them; in float32 there are none, and under FSDP the gathered bf16 weights are those casts."""
    one = plan_for(devices=Devices("cuda", 1, 1, 80.0))
    cast = (900_000_000 + 100_000 * 2048) * 2 / GIB  # SHAPE's linear weights and its (tied) LM head's
    assert one.phase("generation").parts["weights cast for autocast"] == pytest.approx(cast)
    assert one.phase("update").parts["weights cast for autocast"] == pytest.approx(cast)
    fp32 = plan_for("actor.dtype=float32", devices=Devices("cuda", 1, 1, 80.0))
    assert not any("autocast" in k for p in fp32.phases for k in p.parts)
    assert not any("autocast" in k for p in plan_for().phases for k in p.parts)  # 8 ranks


def test_activations_per_token_match_what_autograd_keeps():
    """The count per token and layer against the bytes autograd saves in a real forward (the
    difference between 3 layers and 1, so embeddings, head and cast weights drop out), in float32,
    bf16 autocast over float32 weights and bf16 weights, for shapes of other proportions."""
    for hidden, inter, heads, kv in ((128, 344, 4, 2), (96, 512, 6, 6)):
        for weights, ctx in (
            (torch.float32, contextlib.nullcontext),
            (torch.float32, lambda: torch.autocast("cpu", torch.bfloat16)),
            (torch.bfloat16, lambda: torch.autocast("cpu", torch.bfloat16)),
        ):
            rows, length = 2, 50
            saved = {}
            for layers in (1, 3):
                config = tiny_config(
                    vocab_size=50, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                    num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=256,
                )  # fmt: skip
                model = AutoModelForCausalLM.from_config(config, dtype=weights).train()
                ids = torch.randint(3, 50, (rows, length), generator=torch.Generator().manual_seed(0))
                saved[layers] = token_sized_saved_bytes(model, lambda m=model, x=ids: m(input_ids=x).logits.float().sum(), ctx(), rows * length)
            measured = (saved[3] - saved[1]) / 2 / (rows * length)
            shape = replace(SHAPE, hidden=hidden, intermediate=inter, heads=heads, kv_heads=kv, head_dim=hidden // heads)
            param_bytes = 4 if weights == torch.float32 else 2
            compute = 4 if ctx is contextlib.nullcontext else 2
            planned = activation_bytes_per_token(shape, param_bytes=param_bytes, compute_bytes=compute, lean=False)
            assert planned == pytest.approx(measured, rel=0.02), (hidden, weights, ctx)


def token_sized_saved_bytes(model, run, context, tokens: int) -> int:
    """Bytes of the distinct storages autograd keeps while `run()` executes whose first dimension
    (or, for attention tensors, third) is a token count: activations, not cast weights."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        per_token = t.numel() and (t.shape[0] == tokens or t.numel() % tokens == 0 and t.dim() >= 3)
        if ptr not in params and per_token:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    with context, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(storages.values())


# ------------------------------------------------------------------------- the source's job, dry
def test_the_source_recipe_for_a_7b_vlm_fits_8_gpus_without_offload_and_one_is_refused(tmp_path, capsys):
    """8 x 80 GB cards (79.2 GiB as they report it): ZeRO-3 keeps the update in eighths, so the
    recipe fits without FSDP's offload, AdamW on the GPUs, its vLLM share (0.8) within the
    plan's generation budget; one card is refused with what would fit; cards of unknown memory
    (a dry run on a laptop) get the plan per device and the line that says how to check it."""
    folder = architectures.write_config("qwen2.5-vl-7b", tmp_path)
    cfg = load_config(SOURCE, [])
    assert not cfg.actor.fsdp_offload and cfg.rollout.gpu_memory_utilization == 0.8
    base = ["train", "--dry-run", SOURCE, f"model.path={folder}"]
    assert main([*base, "trainer.n_gpus_per_node=8", "trainer.gpu_memory_gb=79.2"]) == 0
    out = capsys.readouterr().out
    assert "8.29B parameters" in out and "devices: 1 node x 8 GPUs of 79.2 GiB: fits, " in out
    share = float(out.split("may take up to rollout.gpu_memory_utilization=")[1].split()[0])
    assert 0.8 < share < 0.9 and "optimizer state (offloaded)" not in out and "gradient shard" in out
    assert main([*base, "trainer.n_gpus_per_node=1", "trainer.gpu_memory_gb=79.2"]) == 1
    refused = [line for line in capsys.readouterr().out.splitlines() if "memory plan: the update phase needs" in line]
    assert len(refused) == 1 and "would fit with: trainer.n_gpus_per_node=8" in refused[0]
    assert "trainer.memory_check=warn" in refused[0]
    # a dry run for GPUs this machine lacks: the plan, no refusal
    assert main([*base, "trainer.n_gpus_per_node=8"]) == 0
    out = capsys.readouterr().out
    assert "devices: 1 node x 8 GPUs of unknown memory: set trainer.gpu_memory_gb to check the fit" in out
    assert "peak per device" in out and "vLLM takes rollout.gpu_memory_utilization=0.80 of each device" in out


def test_the_source_recipe_keeps_float32_master_weights_and_bf16_weights_at_its_lr_are_warned():
    cfg = load_config(SOURCE, [])
    assert cfg.model.dtype == "float32" and cfg.actor.dtype == "bfloat16" and cfg.actor.optim.lr == 1e-6
    assert lr_resolution_warning(cfg) is None
    warning = lr_resolution_warning(load_config(SOURCE, ["model.dtype=bfloat16"]))
    assert "actor.optim.lr=1e-06 is below what bfloat16 weights can move by" in warning
    # the reason, in numbers: one AdamW step of lr 1e-6 leaves a bf16 weight of 0.02 where it was
    w = torch.full((4,), 0.02, dtype=torch.bfloat16, requires_grad=True)
    opt = torch.optim.AdamW([w], lr=1e-6, weight_decay=0.0)
    w.grad = torch.ones_like(w)
    before = w.detach().clone()
    opt.step()
    assert torch.equal(w.detach(), before)


# ------------------------------------------------------------------------- devices
def test_devices_are_the_named_ones_or_those_present(monkeypatch):
    cfg = load_config(None, ["trainer.n_gpus_per_node=4", "trainer.nnodes=2", "trainer.gpu_memory_gb=40"])
    assert devices_for(cfg) == Devices("cuda", 2, 4, 40.0, named=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    unknown = devices_for(load_config(None, ["trainer.n_gpus_per_node=4"]))  # GPUs this machine lacks
    assert unknown == Devices("cuda", 1, 4, 0.0, named=True) and not unknown.known
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    here = devices_for(load_config(None, ["trainer.device=cpu"]))
    assert (here.kind, here.nodes, here.per_node, here.named) == ("cpu", 2, 2, False) and here.memory_gb > 1


def test_vllm_on_a_cpu_takes_the_cache_its_rollout_can_fill_not_a_share_of_the_host():
    """vLLM's CPU build takes gpu_memory_utilization of the host per engine (two ranks at 0.5: all
    of it); on a CPU the KV cache is what one rank's rollout can fill: rows x context x bytes."""
    cfg = load_config(None, [
        "rollout.engine=vllm", "data.train_batch_size=8", "rollout.n_agent=4", "data.max_prompt_length=200",
        "rollout.max_response_length=56", "rollout.dtype=float32",
    ])  # fmt: skip
    settled = settle_for_devices(cfg, SHAPE, Devices("cpu", 1, 2, 24.0))
    need = (8 // 2) * 4 * 256 * (30 * 2 * 4 * 128 * 4) / GIB  # rows x tokens x KV bytes per token
    assert settled.rollout.kv_cache_gb == pytest.approx(1.1 * need, abs=1e-3)
    assert settled.rollout.max_model_len == 256
    on_gpus = settle_for_devices(cfg, SHAPE, Devices("cuda", 1, 2, 80.0)).rollout
    assert (on_gpus.kv_cache_gb, on_gpus.max_model_len) == (0.0, 256)  # a GPU's share is its own
    explicit = load_config(None, ["rollout.engine=vllm", "rollout.kv_cache_gb=0.5", "rollout.max_model_len=100"])
    assert settle_for_devices(explicit, SHAPE, Devices("cpu", 1, 2, 24.0)).rollout == explicit.rollout


def test_auto_settings_resolve_by_device_and_model_size(monkeypatch):
    """What a GPU user expects on a GPU and a CPU user on a CPU, from one set of defaults: vLLM
    where it is installed on CUDA (an asynchronous run's kept awake), gradient checkpointing from
    1B parameters on CUDA, a 16,384-token budget per micro-batch on CUDA (at least the longest
    sequence); the built-in engine, no checkpointing and row-counted micro-batches on a CPU."""
    import importlib.util

    cfg = load_config(None, [])
    assert (cfg.rollout.engine, cfg.model.gradient_checkpointing, cfg.actor.micro_batch_tokens) == ("auto", "auto", "auto")
    cpu = settle_for_devices(cfg, SHAPE, Devices("cpu", 1, 1, 24.0))
    assert (cpu.rollout.engine, cpu.model.gradient_checkpointing, cpu.actor.micro_batch_tokens) == ("hf", False, 0)
    assert cpu.actor.reference_offload is False  # the host is the device
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real_find_spec(name, *a))
    gpu = settle_for_devices(cfg, SHAPE, Devices("cuda", 1, 8, 80.0))
    assert (gpu.rollout.engine, gpu.model.gradient_checkpointing, gpu.actor.micro_batch_tokens) == ("vllm", True, 16384)
    assert gpu.actor.reference_offload is True and gpu.actor.optimizer_offload is False
    small = settle_for_devices(cfg, replace(SHAPE, params=500_000_000), Devices("cuda", 1, 1, 80.0))
    assert small.model.gradient_checkpointing is False
    long = settle_for_devices(load_config(None, ["data.max_prompt_length=20000"]), SHAPE, Devices("cuda", 1, 1, 80.0))
    assert long.actor.micro_batch_tokens == 20000 + 128
    ahead = settle_for_devices(load_config(None, ["rollout.max_staleness=1"]), SHAPE, Devices("cuda", 1, 1, 80.0))
    assert (ahead.rollout.engine, ahead.rollout.sleep_level) == ("vllm", 0)
    quantised = load_config(None, ["model.quantization=4bit", "model.lora.rank=8"])
    assert settle_for_devices(quantised, SHAPE, Devices("cuda", 1, 1, 80.0)).rollout.engine == "hf"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real_find_spec(name, *a))
    assert settle_for_devices(cfg, SHAPE, Devices("cuda", 1, 1, 80.0)).rollout.engine == "hf"  # not installed here
    assert settle_for_devices(cfg, SHAPE, Devices("cuda", 1, 8, 80.0, named=True)).rollout.engine == "vllm"  # a plan for there


# ------------------------------------------------------------------------- a run
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model")


def test_a_run_that_would_not_fit_stops_before_its_model_loads(tmp_path, model_dir, monkeypatch, caplog):
    config = write_run_config(tmp_path, model_dir)
    monkeypatch.setattr(trainer_setup, "load_causal_lm", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(UserError) as refused:
        Trainer(load_config(config, ["trainer.gpu_memory_gb=0.001"]))
    line = str(refused.value)
    assert "\n" not in line and line.startswith("memory plan: the ") and "0.0 (largest: runtime" in line
    written = json.loads((tmp_path / "runs" / "run" / "memory_plan.json").read_text())
    assert written["fits"] is False and set(written["phases"]) == {"startup", "generation", "update"}
    monkeypatch.undo()
    with caplog.at_level(logging.WARNING):
        summary = Trainer(load_config(config, ["trainer.gpu_memory_gb=0.001", "trainer.memory_check=warn", "trainer.total_steps=1"])).fit()
    assert summary and any(r.getMessage().startswith("memory plan: the ") for r in caplog.records)


def test_a_run_writes_its_plan_and_logs_each_phases_peak(tmp_path, model_dir, capsys):
    """The plan takes the data's longest prompt (in a run and in a dry run, which reads the data
    as the run does), its rows from the rank's share of the batch."""
    config = write_run_config(tmp_path, model_dir)
    trainer = Trainer(load_config(config, ["trainer.total_steps=2", "trainer.val_before_train=false"]))
    longest = max(len(p) for p in trainer.parts.collect.train_prompts + trainer.parts.evaluate.prompts if p)
    assert longest < 64  # the limit
    trainer.fit()
    run = tmp_path / "runs" / "run"
    plan = json.loads((run / "memory_plan.json").read_text())
    assert plan["fits"] and plan["devices"]["kind"] == "cpu" and plan["phases"]["update"]["peak_gb"] > 0
    assert plan["resolved"]["micro-batch"].startswith(f"4 rows of 6 response tokens on 1 prompt(s) of {longest} (the data's longest)")
    assert main(["train", "--dry-run", str(config)]) == 0
    out = capsys.readouterr().out
    assert f"data: the longest of 12 prompts is {longest} tokens (images counted), of data.max_prompt_length=64" in out
    assert f"on 1 prompt(s) of {longest} (the data's longest)" in out
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"actor/' in line]
    assert "perf/peak_gb/startup" in steps[0] and "perf/peak_gb/startup" not in steps[1]
    for m in steps:  # within the process's lifetime peak (getrusage counts a little differently)
        assert 0 < m["perf/peak_gb/generation"] <= m["perf/peak_rss_gb"] + 0.01
        assert 0 < m["perf/peak_gb/update"] <= m["perf/peak_rss_gb"] + 0.01


def test_the_meter_sees_a_phases_own_peak():
    meter = PeakMeter(torch.device("cpu"))
    meter.start()
    big = torch.ones(256 * 2**20 // 4)  # 256 MiB, touched
    first = meter.read()["peak"]
    del big
    meter.start()
    second = meter.read()["peak"]
    assert first - second > 0.2  # the second phase does not see the first's tensor


@pytest.mark.slow
def test_the_plan_is_within_15_percent_of_the_measured_peaks_on_one_process_and_two_ranks(tmp_path):
    """A 133M-parameter model (float32, 3 wide layers) trained two steps as its own process and on
    2 ranks under torchrun (ZeRO-3): each phase's planned peak per rank (memory_plan.json) within
    15% of the resident set it measured (step 1's start-up, step 2's generation and update, once
    AdamW's state exists). Responses run to their limit, as the plan assumes; the plan takes the
    data's longest prompt. (benchmarks/memory_plan.py: a 331M model on 1, 2 and 4 ranks.)"""
    from helpers import run_grouprl, train_here

    model_dir = tmp_path / "model"
    tiny_model_and_tokenizer(
        model_dir, init_std=0.02, hidden_size=2048, intermediate_size=5504, num_hidden_layers=3,
        num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=512,
    )  # fmt: skip
    config = write_run_config(
        tmp_path, model_dir,
        data={"val_files": [], "train_batch_size": 2, "max_prompt_length": 32},
        rollout={"n_agent": 4, "max_response_length": 12},
        actor={"micro_batch_size": 4, "dtype": "float32", "optim": {"lr": 1e-5}},
        trainer={"total_steps": 2, "save_final": False, "save_best": False, "save_last": False, "val_before_train": False},
    )  # fmt: skip
    for ranks in (1, 2):  # one process here (the plan's runtime is this process's), two under torchrun
        if ranks == 1:
            train_here(config, "rollout.dtype=float32", "trainer.experiment_name=r1")
        else:
            run_grouprl(ranks, "train", str(config), "rollout.dtype=float32", f"trainer.experiment_name=r{ranks}")
        run = tmp_path / "runs" / f"r{ranks}"
        plan = json.loads((run / "memory_plan.json").read_text())["phases"]
        steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert [s["response/length_max"] for s in steps] == [12, 12]  # micro-batches padded to the limit
        measured = {
            "startup": steps[0]["perf/peak_gb/startup"],
            "generation": steps[1]["perf/peak_gb/generation"],
            "update": steps[1]["perf/peak_gb/update"],
        }
        for phase, got in measured.items():
            print(f"{ranks} rank(s), {phase}: planned {plan[phase]['peak_gb']:.3f} GiB, measured {got:.3f}")
            assert plan[phase]["peak_gb"] == pytest.approx(got, rel=0.15), (ranks, phase, plan[phase], got)
