"""A decode loop timed on the thread that loaded the model and on a second thread, in turns.

    .venv/bin/python benchmarks/thread_team.py             # SmolLM2's layout at width 64 (a small step)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/thread_team.py

On a CPU, torch's intra-op threads form a team per thread that computes; a second thread that
computes beside the first runs a second team on the same cores. The loop here (the trajectory
schedule's running batch, 8 rows over 300 cached tokens, 30 steps) runs on the main thread, then
on a worker thread, then on the main thread again: printed, each run's milliseconds a step. This
is why the trajectory schedule steps its engine on the thread that called the rollout.
"""

from __future__ import annotations

import concurrent.futures
import statistics
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from grouprl import cpu
from grouprl.config import ModelConfig
from grouprl.rollout.engines.running_batch import RunningBatch
from grouprl.trainer.models import resolve_model_path

ROWS, CONTEXT, STEPS = 8, 300, 30


def main() -> None:
    config = AutoConfig.from_pretrained(resolve_model_path(ModelConfig(path="builtin:smollm2-135m-instruct")))
    config.update(dict(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=32))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(100, 1000, (ROWS, CONTEXT))
    mask = torch.ones(ROWS, CONTEXT, dtype=torch.long)
    mask[: ROWS // 2, :20] = 0  # rows of different lengths

    @torch.no_grad()
    def run() -> float:
        cache = DynamicCache()
        model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True, logits_to_keep=1)
        batch = RunningBatch(cache, ROWS, CONTEXT + STEPS)
        batch.join(cache, mask, torch.full((ROWS,), CONTEXT), STEPS)
        token = torch.randint(100, 1000, (ROWS,))
        times = []
        with cpu.fast_decode(model):
            for _ in range(STEPS):
                start = time.perf_counter()
                batch.forward(model, token)
                times.append(time.perf_counter() - start)
        return 1000 * statistics.median(times)

    worker = concurrent.futures.ThreadPoolExecutor(1)
    print(f"{torch.get_num_threads()} intra-op threads; ms a decode step (median of {STEPS}):")
    for where in ["main", "main", "worker", "worker", "main", "main"]:
        ms = run() if where == "main" else worker.submit(run).result()
        print(f"  {where:>6} thread: {ms:5.1f}")


if __name__ == "__main__":
    main()
