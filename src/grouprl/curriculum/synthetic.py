"""Synthetic trajectory logs and a matching dataset, for tests and the build benchmark.

    paths = write_synthetic(folder, records=1_000_000, agents=5)
    # paths["logs"]: logs.jsonl in the source layout (or a JSON array, or grouprl's rollouts.jsonl)
    # paths["dataset"]: train.parquet in the verl layout with an `id` column

Each uid has a latent solve probability drawn from a mixture (mostly solved, in between, mostly
failed); an agent that solves it ranks the gold page 1st..5th (NDCG 1/log2(rank+1)), otherwise
scores 0, so all-equal groups (all 0 or all 1) occur as in real logs. The judge score agrees
with retrieval most of the time; the training reward is 0.8 x judge + 0.2 x NDCG. The dataset
holds `keep_share` of the log's uids plus `extra_share` uids the log never saw, in shuffled
order, and `duplicates` repeated rows; every `malformed_every`-th log line is cut short.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

RESPONSE = json.dumps(
    "<think>The question asks for a figure on one slide; search first.</think>"
    "<search>quarterly revenue by region</search><information>[3 pages]</information>"
    "<think>Page 3 shows the table.</think><answer>42</answer>"
)
NDCG_BY_RANK = [1.0 / math.log2(rank + 1) for rank in range(1, 6)]


def write_synthetic(
    folder: str | Path,
    records: int,
    agents: int = 5,
    *,
    layout: str = "source",
    array: bool = False,
    seed: int = 0,
    keep_share: float = 0.85,
    extra_share: float = 0.2,
    duplicates: int = 3,
    malformed_every: int = 0,
) -> dict[str, Path]:
    """Write the logs and the dataset into `folder`; `layout` is "source" or "grouprl"."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    n_uids = max(1, records // agents)
    uids = 100_000 + np.arange(n_uids)
    kind = rng.choice(3, size=n_uids, p=[0.45, 0.35, 0.20])
    solve = np.choose(
        kind, [rng.uniform(0.8, 1.0, n_uids), rng.uniform(0.2, 0.8, n_uids), rng.uniform(0.0, 0.1, n_uids)]
    )
    solve = np.where(rng.random(n_uids) < 0.1, np.round(solve), solve)  # some always/never solved

    record_uid = np.repeat(np.arange(n_uids), agents)[:records]
    record_uid = np.concatenate([record_uid, rng.integers(0, n_uids, records - len(record_uid))])
    agent = np.arange(records) % agents
    solved = rng.random(records) < solve[record_uid]
    rank = np.minimum(rng.geometric(0.5, records) - 1, 4)  # gold page mostly near the top
    ndcg = np.where(solved, np.array(NDCG_BY_RANK)[rank], 0.0)
    judge = np.where(rng.random(records) < 0.85, solved, ~solved).astype(float)
    reward = 0.8 * judge + 0.2 * ndcg

    # python lists: f-strings of numpy scalars would write np.float64(...)
    record_uid, agent, rank = record_uid.tolist(), agent.tolist(), rank.tolist()
    ndcg, judge, reward, uids_list = ndcg.tolist(), judge.tolist(), reward.tolist(), uids.tolist()
    log_path = folder / ("rollouts.jsonl" if layout == "grouprl" else "logs.json" if array else "logs.jsonl")
    with open(log_path, "w", encoding="utf-8") as f:
        if array:
            f.write("[\n")
        for r in range(records):
            u = uids_list[record_uid[r]]
            if layout == "grouprl":
                line = (
                    f'{{"run": "phase1", "step": {r // (agents * 64)}, "uid": "{u}", "sample": {agent[r]}, '
                    f'"prompt": "question {u}", "response": {RESPONSE}, "turns": 2, '
                    f'"retrieved": ["{u}_p{rank[r] + 1}"], "rewards": {{"judge": {judge[r]!r}, "ndcg": {ndcg[r]!r}}}, '
                    f'"reward": {reward[r]!r}, "advantage": 0.0, "response_tokens": 57, "truncated": false, '
                    f'"finish_reason": "stop", "ground_truth": "42"}}'
                )
            else:
                line = (
                    f'{{"step": {r // (agents * 64)}, "agent_id": {agent[r]}, "question": "question {u}", '
                    f'"response": {RESPONSE}, "reference_documents": ["/data/images/uid_{u}_page_3.jpg", '
                    f'"/data/images/uid_{u}_page_4.jpg"], "retrieved_documents": ["/data/images/uid_{u}_page_{rank[r] + 1}.jpg"], '
                    f'"ndcg_value": {ndcg[r]!r}, "vlm_score": {judge[r]!r}, "final_score": {reward[r]!r}}}'
                )
            if malformed_every and (r + 1) % malformed_every == 0 and not array:
                line = line[: len(line) // 2]
            f.write(line + (",\n" if array and r + 1 < records else "\n"))
        if array:
            f.write("]\n")

    kept = uids[rng.random(n_uids) < keep_share]
    extra = 900_000_000 + np.arange(int(n_uids * extra_share))
    rows = np.concatenate([kept, extra, kept[:duplicates]])
    rows = rows[rng.permutation(len(rows))]
    table = pa.table(
        {
            "data_source": pa.array(["slidevqa"] * len(rows)),
            "prompt": pa.array([[{"role": "user", "content": f"question {u}"}] for u in rows.tolist()]),
            "reward_model": pa.array([{"style": "rule", "ground_truth": "42"} for _ in range(len(rows))]),
            "extra_info": pa.array([{"index": i, "reference_page": 3} for i in range(len(rows))]),
            "id": pa.array([str(u) for u in rows.tolist()]),
        }
    )
    dataset_path = folder / "train.parquet"
    pq.write_table(table, dataset_path)
    return {"logs": log_path, "dataset": dataset_path}
