"""`rollout.engine=vllm` on several ranks (torchrun, gloo on CPU, FSDP2): each rank runs an
in-process vLLM engine of its own on its share of the groups, and the run is the one of one
process on vLLM: the same samples, rewards and advantages, the same losses and weights; every
rank's engine samples from the weights pushed to it (the engine-trainer log-prob gap stays at
float noise at every step, on both ranks: the metric is the largest over the ranks). Runs in the
vLLM environment (`-m vllm`), on the tiny Llama with head size 32 that vLLM's CPU attention takes."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from tiny import LOWER_FRACTION, write_run_config

from grouprl.rollout.engines.streams import RowStreams
from grouprl.rollout.engines.vllm import request_seeds
from helpers import REORDERED, free_port, run_grouprl, tiny_model_and_tokenizer

pytestmark = pytest.mark.vllm

TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1)
SETTINGS = [
    "rollout.engine=vllm",
    "rollout.kv_cache_gb=0.25",
    "rollout.enforce_eager=true",
    "rollout.max_model_len=128",
    "rollout.check_log_probs=true",
    "data.train_batch_size=4",
    "rollout.n_agent=4",
    "rollout.max_response_length=8",
    "actor.micro_batch_size=3",
    "actor.mini_batch_size=2",  # two optimizer steps per step, one group per rank in each
    "actor.dtype=float32",
    "actor.optim.lr=2e-2",
    "trainer.total_steps=2",
    "trainer.save_best=false",
]


def train(config, ranks: int, name: str) -> str:
    """A run of `ranks` processes named `name`; its output."""
    done = run_grouprl(ranks, "train", str(config), *SETTINGS, f"trainer.experiment_name={name}")
    return done.stdout + done.stderr


def records(run_dir):
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rollouts = [
        (r["step"], r["uid"], r["sample"], r["response"], r["reward"], round(r["advantage"], 6))
        for r in map(json.loads, (run_dir / "rollouts.jsonl").read_text().splitlines())
    ]
    steps = {m["step"]: m for m in lines if "actor/grad_norm" in m}
    evals = [m["val/accuracy"] for m in lines if "val/accuracy" in m]
    return steps, rollouts, evals


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("parallel-vllm")
    model = root / "model"
    tiny_model_and_tokenizer(model, init_std=0.02, **TINY)
    config = write_run_config(root, model, reward=LOWER_FRACTION)
    outputs = {ranks: train(config, ranks, f"vllm-{ranks}") for ranks in (1, 2)}
    return root, outputs


def test_two_ranks_on_vllm_equal_one_process(runs):
    root, outputs = runs
    (one, one_rollouts, one_evals), (two, two_rollouts, two_evals) = (
        records(root / "runs" / f"vllm-{ranks}") for ranks in (1, 2)
    )
    assert two_rollouts == one_rollouts  # same prompts, samples, rewards, advantages, in order
    assert len(one_rollouts) == 2 * 16 and len({r[3] for r in one_rollouts}) > 10
    assert sorted(one) == sorted(two) == [1, 2]
    for step in (1, 2):
        assert two[step]["dist/world_size"] == 2 and one[step]["dist/world_size"] == 1
        for key in ("reward/mean", "actor/pg_loss", "actor/ppo_kl", "actor/clipfrac", "actor/grad_norm"):
            assert two[step][key] == pytest.approx(one[step][key], **REORDERED), (step, key)
        gaps = [run[step]["rollout/mismatch_mean"] for run in (one, two)]
        assert gaps[1] == pytest.approx(gaps[0], abs=1e-6)
    assert two_evals == one_evals and len(one_evals) == 2  # greedy; held-out prompts split over the engines
    w1, w2 = (load_file(str(root / "runs" / f"vllm-{r}" / "final" / "model.safetensors")) for r in (1, 2))
    start = load_file(str(root / "model" / "model.safetensors"))
    assert max(float((w1[n] - start[n]).abs().max()) for n in w1) > 1e-3  # training moved the weights
    assert w1.keys() == w2.keys()
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], rtol=0, atol=1e-4)
    assert outputs[2].count("vLLM engine ready") == 2  # an engine on each rank


def test_every_ranks_engine_samples_from_the_pushed_weights(runs):
    """Step 2's samples come from the weights step 1's update pushed into each rank's engine: the
    engine's log-probs of its samples equal the trainer's to float noise at both steps, on the
    rank where the gap is largest (`_max` is reduced over the ranks)."""
    root, _ = runs
    two, _, _ = records(root / "runs" / "vllm-2")
    for step in (1, 2):
        assert two[step]["rollout/mismatch_max"] < 1e-5, (step, two[step]["rollout/mismatch_max"])
        assert two[step]["time/weight_sync"] > 0 and two[step]["time/weight_push"] > 0


def test_a_groups_seed_does_not_depend_on_the_ranks_split():
    """vLLM seeds each request (a prompt's n samples) from its first row's stream: the seeds of a
    rank's part of a batch are those the whole batch gives its groups."""
    n = 4
    whole = request_seeds(RowStreams(7, range(4 * n)), 4, n)
    halves = [request_seeds(RowStreams(7, range(r * 2 * n, (r + 1) * 2 * n)), 2, n) for r in (0, 1)]
    assert halves[0] + halves[1] == whole and len(set(whole)) == 4
    assert request_seeds(RowStreams(8, range(4 * n)), 4, n) != whole
    with pytest.raises(ValueError, match="6 row streams for 2 prompts x 4 samples"):
        request_seeds(RowStreams(7, range(6)), 2, n)


ENGINE_LIFE = """
import gc, sys
import torch, torch.distributed as dist
from helpers import tiny_model_and_tokenizer
from grouprl.rollout.engines.base import SamplingParams
from grouprl.rollout.engines.vllm import VLLMEngine

class Settings:
    gpu_memory_utilization, kv_cache_gb, tensor_parallel_size, sleep_level = 0.5, 0.25, 1, 0
    enforce_eager, max_model_len, temperature, top_k, top_p = True, 128, 1.0, 0, 1.0

dist.init_process_group("gloo")
rank = dist.get_rank()
model, tokenizer = tiny_model_and_tokenizer(init_std=0.2, hidden_size=64, intermediate_size=128,
                                            num_attention_heads=2, num_key_value_heads=1)
params = SamplingParams(max_new_tokens=4, temperature=1.0)
for life in ("dropped", "kept"):
    engine = VLLMEngine(model, tokenizer, sys.argv[1], Settings, max_model_len=128)
    assert len(engine.generate([[5, 6, 7 + rank]], 2, params, torch.Generator().manual_seed(0))) == 2
    if life == "dropped":
        del engine
        gc.collect()
        total = torch.ones(1)
        dist.all_reduce(total)  # the trainer's group outlived the engine
        assert total.item() == 2
print(f"rank {rank} done", flush=True)
dist.destroy_process_group()  # the trainer leaves its group; the engine is collected at exit
"""


def test_an_engine_beside_the_trainers_group_leaves_that_group_alone(tmp_path):
    """vLLM's teardown ends with destroying the default group: an engine collected mid-run must not
    take the trainer's group with it, a second engine starts on the groups the first made, and one
    collected at exit, after the trainer left its group, exits without an error."""
    folder = tmp_path / "model"
    tiny_model_and_tokenizer(folder, init_std=0.2, **TINY)
    script = tmp_path / "engine_life.py"
    script.write_text(ENGINE_LIFE)
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    done = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
            f"--master-port={free_port()}", str(script), str(folder),
        ],  # fmt: skip
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "rank 0 done" in done.stdout and "rank 1 done" in done.stdout
    assert "Traceback" not in done.stderr and "Invalid process group" not in done.stderr, done.stderr[-3000:]
