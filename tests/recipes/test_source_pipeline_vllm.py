"""The source system's run, scaled down to a CPU: `configs/source_phase2.yaml` as it is, with
overrides only for sizes and addresses, on 2 ranks under torchrun (gloo, FSDP2), each rank
generating with its own in-process vLLM engine (vLLM's CPU build), a tiny VLM (Idefics3, the
embedded VLM's family) as the searcher, the built-in slides task with page images searched
through a real `grouprl retriever serve` process, the frozen answer generator and the judge on a
fake OpenAI-compatible server on 127.0.0.1, the reward 0.8 x judge + 0.2 x NDCG streamed per
group, 2 steps, the export at the end.

A random tiny policy never writes an action, so its first three turns are scripted in vLLM's
sampler (tests/recipes/forced_vllm.py: only the scripted token may be drawn; the log-prob vLLM
reports is the model's own): search, crop the page shown, declare the search complete. Checked:
every trajectory of both ranks in rollouts.jsonl with the page it was shown and the crop, the
rewards of both parts, the engine-trainer log-prob gap per step and per turn (the recipe's bf16
compute: bf16's rounding), the rewards streamed, and `final/` loading as a VLM.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from grouprl.retriever.index import build_index
from grouprl.rollout.gold import write_slides_task
from helpers import free_port
from retriever.sample_index import shared_embedder
from rewards.judges.fake_server import FakeJudgeServer, Reply
from vision_helpers import VLLM_TEXT, tiny_vlm

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
FORCED = Path(__file__).with_name("forced_vllm.py")
ANSWER_MODEL = "frozen-answerer"
# how an observation opens right after an action: the next user message (the tiny VLM's chat
# template writes "role: content" lines)
OBSERVATION_OPENINGS = ("\nuser:",)




def behaviour(call):
    """The answer generator answers; the judge grades every other call 1, else 0 (rewards that
    differ within a group)."""
    if call.body.get("model") == ANSWER_MODEL:
        return Reply(content="<answer>slide</answer>")
    accuracy = call.number % 2
    return Reply(content=json.dumps({"accuracy": accuracy, "grounding": 1, "consistency": 1}))


class RetrieverProcess:
    """`grouprl retriever serve` in a process of its own, on a free port of 127.0.0.1."""

    def __init__(self, index: Path, log: Path):
        self.port = free_port()
        self.log = open(log, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "grouprl", "retriever", "serve", "--index", str(index), "--port", str(self.port)],
            stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, Path(log).read_text()[-2000:]
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.3)
        raise AssertionError("the retrieval service did not start")

    def close(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()


def test_the_source_run_scaled_down_on_two_ranks_with_vllm(tmp_path):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    data = write_slides_task(tmp_path / "data", n_train=4, n_val=2, n_decks=2, image_size=(64, 64))
    build_index(data.corpus, tmp_path / "index", embedder=shared_embedder(), mode="bm25")
    model = tmp_path / "vlm"
    _, tokenizer, _ = tiny_vlm("idefics3", model, text_sizes={**VLLM_TEXT, "max_position_embeddings": 8192}, split=True)
    word = json.loads(data.corpus.read_text().splitlines()[0])["title"].split()[0]
    scripts = [f"<search>{word}</search>", "<bbox>[0, 0, 16, 16]</bbox>", "<search_complete>true</search_complete>"]
    forced = {
        "scripts": [tokenizer(s, add_special_tokens=False)["input_ids"] for s in scripts],
        "after": [tokenizer(mark, add_special_tokens=False)["input_ids"] for mark in OBSERVATION_OPENINGS],
    }

    service = RetrieverProcess(tmp_path / "index", tmp_path / "retriever.log")
    try:
        with FakeJudgeServer(behaviour=behaviour).start() as server:
            overrides = [
                f"data.train_files=[{data.train}]", "data.val_files=[]", "data.train_batch_size=2",
                f"model.path={model}",  # the recipe's memory settings as they are (float32 weights,
                # vLLM's share): on a CPU each rank's cache is what its rollout can fill
                "rollout.n_agent=2", "rollout.max_response_length=48",
                "rollout.enforce_eager=true", "rollout.check_log_probs=true",
                "agent.max_turns=3", "agent.max_observation_tokens=200",  # the crop, the last-turn note, turn markers
                f"agent.answer_base_url={server.base_url}", f"agent.answer_model={ANSWER_MODEL}",
                f"agent.retriever.url=http://127.0.0.1:{service.port}/search",
                f"reward.judges[0].base_url={server.base_url}", "reward.judges[0].cache_path=",
                "reward.judges[0].max_retries=1", "reward.judges[0].backoff_base_s=0.001",
                "actor.mini_batch_size=2", "actor.micro_batch_size=2",  # the recipe's bf16 compute
                "actor.optim.warmup_steps=0", "actor.optim.warmup_ratio=0",
                "trainer.total_steps=2", "trainer.device=cpu", f"trainer.output_dir={tmp_path / 'runs'}",
                "trainer.experiment_name=source", "trainer.loggers=[jsonl]", "trainer.save_freq=0",
                "trainer.resume_mode=disable",
            ]  # fmt: skip
            env = {
                **os.environ,
                "OMP_NUM_THREADS": "1",
                "GEMINI_API_KEY": "test-key-not-sent-anywhere-else",
                "GROUPRL_FORCED_TURNS": json.dumps(forced),
            }
            done = subprocess.run(
                [
                    sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
                    f"--master-port={free_port()}", str(FORCED), "train", str(ROOT / "configs" / "source_phase2.yaml"),
                    *overrides,
                ],  # fmt: skip
                env=env, capture_output=True, text=True, timeout=900,
            )
            assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
            assert server.requests > 0
    finally:
        service.close()

    run = tmp_path / "runs" / "source"
    assert done.stdout.count("vLLM engine ready") + done.stderr.count("vLLM engine ready") == 2  # one per rank
    # the memory plan gave each rank's engine the KV cache its rollout fills (the recipe's share,
    # 0.5 of the host per engine, would have taken all of this machine's memory with two ranks)
    plan = json.loads((run / "memory_plan.json").read_text())
    assert plan["fits"] and plan["devices"]["per_node"] == 2
    engine = plan["phases"]["generation"]["parts"]["engine (vLLM)"]
    assert engine < 0.5 and engine * 2 < 0.1 * plan["devices"]["memory_gb"]
    saved = yaml.safe_load((run / "config.yaml").read_text())["rollout"]
    # the run's longest sequence: the prompt, 3 turns, 2 observations and the frozen answer (256 tokens and a newline)
    assert saved["kv_cache_gb"] == 0.25 and saved["max_model_len"] == 4096 + 3 * 48 + 2 * 200 + 257
    steps = {m["step"]: m for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "time/step" in m}
    assert sorted(steps) == [1, 2]
    for m in steps.values():
        assert m["dist/world_size"] == 2
        assert "reward/judge" in m and "reward/ndcg" in m
        assert m["time/reward_hidden"] >= 0  # scored while generation went on
        assert all(f"rollout/mismatch_mean/turn_{k}" in m for k in (1, 2, 3))
    # bf16, as the recipe computes (vLLM's pixels are the trainer's rounded to bf16): every rank's
    # engine samples the trainer's distribution within bf16's rounding (measured: mean 0.017-0.019,
    # max 0.08)
    assert all(m["rollout/mismatch_mean"] < 0.05 and m["rollout/mismatch_max"] < 0.5 for m in steps.values())
    records = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
    assert len(records) == 2 * 2 * 2  # 2 steps x 2 groups (one per rank) x 2 samples
    for step in (1, 2):
        assert len({r["uid"] for r in records if r["step"] == step}) == 2
    pages = {str(p) for p in data.images.glob("*.png")}
    for r in records:
        actions = [t["action"] for t in r["turns"]]
        assert actions[:3] == ["search", "bbox", "search_complete"], actions
        shown_page, crop = r["turns"][0]["image_files"], r["turns"][1]["image_files"]
        assert len(shown_page) == 1 and shown_page[0] in pages  # the first hit's page, from the service
        assert len(crop) == 1 and crop[0].startswith("<")  # the crop, made in memory
        assert set(r["rewards"]) >= {"judge", "ndcg"}
        assert 0 <= r["rewards"]["ndcg"] <= 1 and 0 <= r["rewards"]["judge"] <= 1
    assert len({r["reward"] for r in records}) > 1
    final = run / "final"
    vlm = AutoModelForImageTextToText.from_pretrained(final)
    assert vlm.config.model_type == "idefics3"
    assert AutoImageProcessor.from_pretrained(final) is not None
