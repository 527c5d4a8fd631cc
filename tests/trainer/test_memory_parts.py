"""The memory plan's arithmetic, worked out by hand on small shapes: the micro-batch a rank runs
(its share of the batch, each group's prompt once, the data's longest prompt), a pass's parts
(activations, the shared prefix's keys and masks, the backward, the LM head) on a CPU and on
CUDA, ZeRO-3's resident parts, the allocator margin, vLLM's generation budget, parts that sum to
the peaks the plan states, and a plan for GPUs whose memory is not known."""

from dataclasses import replace

import pytest

from grouprl.config import load_config
from grouprl.trainer.memory import GIB, Devices, Shape, context_length, micro_batch, plan_memory
from grouprl.trainer.memory.update import PassSettings, activation_parts

SMALL = Shape(
    params=10_000, trainable=10_000, vision=0, linear=8_000, layer=1_000, layers=2, hidden=64, intermediate=128,
    heads=4, kv_heads=2, head_dim=16, vocab=500, root=2_000, positions=4096,
)  # fmt: skip
BIG = Shape(
    params=1_000_000_000, trainable=1_000_000_000, vision=0, linear=900_000_000, layer=30_000_000, layers=30,
    hidden=2048, intermediate=5504, heads=16, kv_heads=4, head_dim=128, vocab=100_000, root=100_000_000,
    positions=32768,
)  # fmt: skip
EIGHT_GPUS = Devices("cuda", 1, 8, 80.0)
ROWS = ["data.train_batch_size=16", "rollout.n_agent=4", "actor.micro_batch_size=8", "data.max_prompt_length=100",
        "rollout.max_response_length=28", "actor.micro_batch_tokens=0"]  # fmt: skip


def cfg_of(*overrides):
    return load_config(None, [*ROWS, *overrides])


# ------------------------------------------------------------------------- the micro-batch
def test_a_ranks_micro_batch_is_its_share_with_each_groups_prompt_once():
    """16 prompts x 4 samples, 8 rows a micro-batch, prompts of 100 and responses of 28 tokens:
    a rank of 8 holds 2 groups (8 rows: one micro-batch, 2 prompts run once each, their
    responses packed 4 to a row of 112); 16 ranks hold a group each (4 rows); the data's longest
    prompt of 60 tokens replaces the limit; without the shared prefix every row runs its prompt."""
    cfg = cfg_of()
    mb = micro_batch(cfg, 8, context_length(cfg), pack_tokens=512)
    assert (mb.rows, mb.prompts, mb.prompt_len, mb.response_len, mb.bins, mb.width) == (8, 2, 100, 28, 2, 112)
    assert mb.tokens == 2 * 100 + 2 * 112 and mb.response_tokens == 8 * 28
    assert micro_batch(cfg, 1, 128, pack_tokens=512).rows == 8  # 64 rows on one rank, 8 a micro-batch
    alone = micro_batch(cfg, 16, 128, pack_tokens=512)
    assert (alone.rows, alone.prompts, alone.tokens) == (4, 1, 100 + 112)
    assert micro_batch(cfg, 8, 128, longest_prompt=60, pack_tokens=512).tokens == 2 * 60 + 2 * 112
    assert micro_batch(cfg, 8, 128, longest_prompt=500, pack_tokens=512).prompt_len == 100  # never past the limit
    unpacked = micro_batch(cfg, 8, 128, pack_tokens=0)  # a bin per response
    assert (unpacked.bins, unpacked.width, unpacked.tokens) == (8, 28, 2 * 100 + 8 * 28)
    plain = micro_batch(cfg_of("actor.shared_prefix=false"), 8, 128, pack_tokens=512)
    assert (plain.rows, plain.prompts, plain.tokens) == (8, 8, 8 * 128)


def test_a_token_budget_takes_whole_groups_while_they_fit_else_a_groups_rows():
    """A group costs its prompt once and its 4 responses: 100 + 4 x 28 = 212 tokens. A budget of
    1,000 takes 4 groups (16 rows); 150 takes one row of a group (100 + 28 <= 150 < 100 + 2 x 28);
    a budget below one row still runs it (a micro-batch of its own)."""
    context = 128
    four = micro_batch(cfg_of("actor.micro_batch_tokens=1000"), 1, context, pack_tokens=512)
    assert (four.rows, four.prompts) == (16, 4)
    one = micro_batch(cfg_of("actor.micro_batch_tokens=150"), 1, context, pack_tokens=512)
    assert (one.rows, one.prompts, one.tokens) == (1, 1, 100 + 28)
    below = micro_batch(cfg_of("actor.micro_batch_tokens=50"), 1, context, pack_tokens=512)
    assert (below.rows, below.prompts) == (1, 1)


def test_an_agents_responses_plan_at_their_limit_with_the_answer():
    """7 turns of 2,048 tokens, 6 observations of 1,536 (images and turn markers included) and the
    frozen generator's answer (256 tokens and a newline) after a 4,096-token prompt."""
    cfg = load_config(None, [
        "agent.enabled=true", "agent.max_turns=7", "rollout.max_response_length=2048", "agent.max_observation_tokens=1536",
        "agent.answer_generator=openai", "agent.answer_model=m", "agent.answer_max_tokens=256", "data.max_prompt_length=4096",
        "actor.micro_batch_tokens=0",
    ])  # fmt: skip
    assert context_length(cfg) == 4096 + 7 * 2048 + 6 * 1536 + 257
    # max_response_tokens stops the observations; the turn under way still runs to its length
    budget = load_config(None, ["agent.enabled=true", "agent.max_response_tokens=3000", "rollout.max_response_length=300"])
    assert context_length(budget) == budget.data.max_prompt_length + 3000 - 1 + 300 + budget.agent.answer_max_tokens + 1
    assert micro_batch(cfg, 8, context_length(cfg)).response_len == 7 * 2048 + 6 * 1536 + 257


# ------------------------------------------------------------------------- a pass's parts
MB = micro_batch(cfg_of(), 8, 128, pack_tokens=512)  # 8 rows, 2 prompts of 100, 2 bins of 112


def test_a_pass_on_a_cpu_by_hand():
    """float32, a CPU's lean layers and attention, no checkpointing, h 64, i 128, kv 32, 2 layers,
    424 tokens (2 prompts once, 2 packed rows of 112)."""
    s = PassSettings(stream=4, compute=4, checkpointing=False, lean_layers=True, lean_attention=True, logits_chunk=256)
    per_token = 4 * (8 * 64 + 4 * 128 + 2 * 32) - (4 * 2 * 64 + 4 * 2 * 128)  # lean: normalised inputs, act, product
    assert per_token == 2816
    masks = 2 * 112 * (100 + 112) + 2 * 100 * 100  # the responses' block mask, the padded prompts'
    assert activation_parts(SMALL, MB, s) == pytest.approx({
        "activations": 424 * 2 * per_token / GIB,
        # the cache's copies of 2 x 100 prompt keys and values per layer, and attention's (unrepeated)
        "prompt keys and values (shared prefix)": (2 * 2 * 2 * 100 * 32 * 4 + 2 * 2 * 2 * 100 * 32 * 4) / GIB,
        "attention masks (4-D)": masks * (1 + 4) / GIB,  # bool, and one float32 copy per forward
        "backward of one layer": (424 * ((2 * 64 + 128) * 4 + (64 + 3 * 128) * 4) + 2 * 2 * 100 * 32 * 4) / GIB,
        "LM head chunk": (224 * 500 * 4 * 3 + 224 * 64 * 4 * 2) / GIB,  # 224 response tokens under a 256 chunk
    })  # fmt: skip


def test_a_pass_on_cuda_under_fsdp_by_hand():
    """bf16 weights gathered (FSDP mixed precision), checkpointed, CUDA: keys and values repeated
    to the 4 query heads under a mask, a floating mask per layer (one at a time: checkpointed)."""
    s = PassSettings(stream=2, compute=2, checkpointing=True, lean_layers=False, lean_attention=False, logits_chunk=256)
    per_token = 4 * 2 * 64 + 2 * (6 * 64 + 4 * 128 + 2 * 32) + 2 * (64 - 32) * 2  # bf16 weights, repeated keys
    masks = 2 * 112 * (100 + 112) + 2 * 100 * 100
    assert activation_parts(SMALL, MB, s) == pytest.approx({
        "activations (layer inputs, checkpointed)": 424 * 2 * 64 * 2 / GIB,
        "activations (the recomputed layer)": 424 * per_token / GIB,
        # copies (every layer), what the recomputed layer keeps (repeated), the prompts' keys kept
        "prompt keys and values (shared prefix)": (2 * 2 * 2 * 100 * 32 * 2 + 2 * 2 * 100 * 64 * 2 + 2 * 2 * 2 * 100 * 32 * 2) / GIB,
        "attention masks (4-D)": masks * (1 + 2) / GIB,
        "backward of one layer": (424 * (2 * 64 + 128) * 2 + 2 * 2 * 100 * 64 * 2) / GIB,
        "LM head chunk": (224 * 500 * 4 * 3 + 224 * 64 * 2 * 2) / GIB,
    })  # fmt: skip


def test_where_the_responses_backward_ends_the_prompt_key_gradients_wait():
    s = PassSettings(stream=4, compute=4, checkpointing=False, lean_layers=False, lean_attention=True, logits_chunk=256)
    prompts = replace(MB, rows=0, bins=0, width=0)
    parts = activation_parts(SMALL, prompts, s, heads=False)
    assert "LM head chunk" not in parts and parts["prompt key/value gradients (shared prefix)"] == pytest.approx(
        2 * 2 * 2 * 100 * 32 * 4 / GIB
    )
    assert parts["activations"] == pytest.approx(200 * 2 * 4 * (8 * 64 + 4 * 128 + 2 * 32) / GIB)


# ------------------------------------------------------------------------- the update's residents
def test_zero3_holds_an_eighth_of_the_state_a_layer_and_the_root_whole():
    """1e9 float32 parameters on 8 GPUs, bf16 compute: an eighth of the weights (0.5 GB), of the
    gradients (0.5 GB) and of AdamW's moments (1 GB); the decoder layer FSDP gathers for its
    backward and its gradient with the reduce-scatter's float32 buffer (30M x (2 + 2 + 4)); the root's
    own weights whole (100M x 2); the LM head's gradient whole (100,000 x 2048 x 2); vLLM asleep
    (its CUDA graphs and buffers, 1.25 GiB); the allocator's margin, 5% of what is allocated."""
    plan = plan_memory(cfg_of("rollout.engine=vllm", "model.gradient_checkpointing=true"), BIG, EIGHT_GPUS)
    update = plan.phase("update").parts
    g = 1e9 / GIB
    expected = {
        "runtime": 1.0, "policy": 4 * g / 8, "optimizer state": 8 * g / 8, "gradient shard": 4 * g / 8,
        "decoder layers gathered (FSDP)": 30e6 * 8 / GIB, "root weights whole (FSDP)": 100e6 * 2 / GIB,
        "LM head gradient whole": 100_000 * 2048 * 2 / GIB, "vLLM asleep (CUDA graphs, buffers)": 1.25,
    }  # fmt: skip
    assert {k: update[k] for k in expected} == pytest.approx(expected)
    margin = next(k for k in update if k.startswith("allocator margin"))
    allocated = sum(v for k, v in update.items() if k not in ("runtime", margin))
    assert update[margin] == pytest.approx(0.05 * allocated)
    # one process: whole gradients in float32 and autocast's bf16 casts of the linear weights
    alone = plan_memory(cfg_of("rollout.engine=vllm"), BIG, Devices("cuda", 1, 1, 80.0)).phase("update").parts
    cast = (0.9e9 + 100_000 * 2048) * 2 / GIB  # the linear weights and the (tied) LM head's, in bf16
    assert alone["gradients"] == pytest.approx(4 * g) and alone["weights cast for autocast"] == pytest.approx(cast)
    assert "gradient shard" not in alone and "root weights whole (FSDP)" not in alone


def test_gradients_waiting_for_the_prompts_pass_are_the_decoders_and_embeddings():
    """One process with the shared prefix and several micro-batches: the responses' weight
    gradients wait for the prompts' pass, the decoder's in bf16 (autocast's cast weights, 30 x
    30M, within the 1e9 trained less the embeddings) and the input embeddings' twice (a dense
    100,000 x 2048 from each pass, the second summed into the first in a copy) in the weights'
    float32. ZeRO-3 runs a micro-batch's prompts as their own pass first, their gradients
    reduced by their own backward: nothing waits there."""
    one_gpu = Devices("cuda", 1, 1, 80.0)
    plan = plan_memory(cfg_of("rollout.engine=vllm", "actor.micro_batch_size=2"), BIG, one_gpu)
    update = plan.phase("update").parts
    embeddings = 100_000 * 2048
    decoder = min(1e9 - embeddings, 30 * 30e6)
    assert update["gradients waiting for the prompts' pass"] == pytest.approx((decoder * 2 + 2 * embeddings * 4) / GIB)
    assert plan.resolved["update peak at"] == "the prompts' backward"
    sharded = plan_memory(cfg_of("rollout.engine=vllm"), BIG, EIGHT_GPUS)
    assert "gradients waiting for the prompts' pass" not in sharded.phase("update").parts
    assert sharded.resolved["update peak at"] == "the backward's start"
    unshared = plan_memory(cfg_of("rollout.engine=vllm", "actor.shared_prefix=false", "actor.micro_batch_size=2"), BIG, one_gpu)
    assert "gradients waiting for the prompts' pass" not in unshared.phase("update").parts


# ------------------------------------------------------------------------- sums, budgets, unknowns
@pytest.mark.parametrize("devices", [EIGHT_GPUS, Devices("cuda", 1, 1, 80.0), Devices("cpu", 1, 2, 24.0)])
@pytest.mark.parametrize("extra", [[], ["rollout.engine=vllm", "actor.kl_loss_coef=0.1"], ["actor.shared_prefix=false"]])
def test_a_plans_parts_sum_to_the_peaks_it_states(devices, extra):
    plan = plan_memory(cfg_of(*extra), BIG, devices)
    written = plan.to_json()["phases"]
    table = plan.table()
    stated = next(line for line in table if line.startswith("peak per device")).split()[3:]
    for phase, printed in zip(plan.phases, stated):
        assert phase.peak == pytest.approx(sum(phase.parts.values()))
        assert written[phase.name]["peak_gb"] == pytest.approx(sum(written[phase.name]["parts"].values()), abs=1e-3)
        assert float(printed) == pytest.approx(phase.peak, abs=0.006)
    assert plan.worst.peak == max(p.peak for p in plan.phases)


def test_vllms_share_is_what_the_trainer_leaves_of_the_device():
    """The generation budget: the device less what the trainer keeps resident while vLLM
    generates (its shards and AdamW's, the runtime, the margin), as a share, rounded down."""
    plan = plan_memory(cfg_of("rollout.engine=vllm", "rollout.gpu_memory_utilization=0.4"), BIG, EIGHT_GPUS)
    resident = sum(v for k, v in plan.phase("generation").parts.items() if k != "engine (vLLM)")
    g = 1e9 / GIB
    assert resident == pytest.approx((1.0 + 12 * g / 8) + 0.05 * 12 * g / 8)
    assert plan.vllm_share == int((80 - resident) / 80 * 100) / 100
    assert any(f"rollout.gpu_memory_utilization={plan.vllm_share:.2f}" in line for line in plan.table())


def test_gpus_of_unknown_memory_are_planned_without_a_verdict():
    """A GPU script's dry run on a machine without its GPUs: the plan per device, no refusal, a
    line saying what would check the fit; vLLM's share of an unknown device is said, not counted."""
    unknown = Devices("cuda", 1, 8, 0.0, named=True)
    plan = plan_memory(cfg_of("rollout.engine=vllm"), BIG, unknown)
    assert not plan.checked and plan.fits and plan.vllm_share is None
    table = plan.table()
    assert table[-3] == "devices: 1 node x 8 GPUs of unknown memory: set trainer.gpu_memory_gb to check the fit"
    resident = plan.phase("generation").peak
    assert table[-2] == f"generation: vLLM takes rollout.gpu_memory_utilization=0.50 of each device beside the trainer's {resident:.1f} GiB"
    assert plan.phase("generation").parts["engine (vLLM)"] == 0 and plan.to_json()["checked"] is False


def test_vllms_longest_sequence_is_the_runs_context_within_the_models_positions():
    settled = plan_memory(cfg_of("rollout.engine=vllm"), BIG, EIGHT_GPUS)
    assert settled.resolved["engine"] == "vllm"
    from grouprl.trainer.memory import settle_for_devices

    assert settle_for_devices(cfg_of("rollout.engine=vllm"), BIG, EIGHT_GPUS).rollout.max_model_len == 128
    short = replace(BIG, positions=100)
    assert settle_for_devices(cfg_of("rollout.engine=vllm"), short, EIGHT_GPUS).rollout.max_model_len == 100
    mine = cfg_of("rollout.engine=vllm", "rollout.max_model_len=64")
    assert settle_for_devices(mine, BIG, EIGHT_GPUS).rollout.max_model_len == 64
