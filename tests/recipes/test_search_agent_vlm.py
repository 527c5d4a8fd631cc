"""configs/search_agent_vlm_sft.yaml then configs/search_agent_vlm.yaml end to end on a tiny
Idefics3 VLM saved to a folder (the embedded VLM's family): the SFT writes the slides task with
page images in its gold observations and trains on them, the saved VLM loads, a BM25 index is
built over the corpus, and the RL recipe runs the agent loop with page images and crops (the
policy's first two turns forced, as a random policy never writes an action) and an update that
scores every policy token as generation did."""

import json
from pathlib import Path

import pytest

from grouprl.config import load_config
from grouprl.retriever.index import build_index
from grouprl.trainer.sft import run_sft
from grouprl.trainer.sft_data import load_conversations
from grouprl.trainer.trainer import Trainer
from retriever.sample_index import shared_embedder
from vision_helpers import ForcedTurns, tiny_vlm

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_the_vlm_search_agent_recipe_runs_sft_then_rl_on_page_images(tmp_path, monkeypatch):
    from transformers import AutoModelForImageTextToText

    tiny_vlm("idefics3", tmp_path / "vlm", vision_init_std=0.2)
    sft_dir = tmp_path / "sft"
    sft = load_config(str(ROOT / "configs" / "search_agent_vlm_sft.yaml"), [
        f"model.path={tmp_path / 'vlm'}", "trainer.device=cpu", "sft.task_train_size=6", "sft.task_val_size=2",
        "sft.max_steps=2", "sft.batch_size=2", "sft.max_length=8192", "sft.eval_max_conversations=2",
        "sft.preview_samples=1", "sft.preview_max_tokens=4", f"sft.output_dir={sft_dir}",
    ])  # fmt: skip
    assert sft.sft.task_page_images and sft.model.freeze_vision_tower
    summary = run_sft(sft)
    data = sft_dir / "data"
    conversations = load_conversations([str(data / "sft_train.jsonl")])
    for c in conversations:  # one page per search observation, its placeholder first in the observation
        observations = [m for m in c.messages[3:] if m["role"] == "user"]
        assert len(c.images) == len(observations) >= 1 and all(m["content"].startswith("<image>") for m in observations)
        assert all(Path(image).is_file() for image in c.images)
    assert summary["steps"] == 2
    assert AutoModelForImageTextToText.from_pretrained(sft_dir / "model").config.model_type == "idefics3"

    build_index(data / "corpus.jsonl", data / "index", embedder=shared_embedder(), mode="bm25")
    word = json.loads((data / "corpus.jsonl").read_text().splitlines()[0])["title"].split()[0]
    cfg = load_config(str(ROOT / "configs" / "search_agent_vlm.yaml"), [
        f"data.train_files=[{data / 'train.parquet'}]", "data.val_files=[]", "data.max_prompt_length=4096",
        f"model.path={sft_dir / 'model'}", f"agent.retriever.index={data / 'index'}", "agent.max_turns=3",
        "agent.max_observation_tokens=160", "rollout.max_response_length=32", "rollout.check_log_probs=true",
        "actor.dtype=float32", "trainer.device=cpu", "trainer.total_steps=1", "trainer.save_freq=0",
        "trainer.save_best=false", "trainer.save_final=false", f"trainer.output_dir={tmp_path / 'runs'}",
    ])  # fmt: skip
    assert cfg.agent.tools == ["search", "bbox"] and cfg.agent.answer_generator == "none"
    trainer = Trainer(cfg)
    ForcedTurns(trainer.parts.tokenizer, [f"<search>{word}</search>", "<bbox>[0, 0, 16, 16]</bbox>"]).install(monkeypatch)
    metrics, trajectories, _ = trainer.train_step()
    assert len(trajectories) == 4 * 4
    for t in trajectories:
        assert [r["action"] for r in t.turns][:2] == ["search", "bbox"]
        assert len(t.response_images) == 2  # the first hit's page, then the crop of it
        assert t.turns[0]["images"] == 1 and t.turns[1]["images"] == 1
    assert metrics["rollout/mismatch_max"] < 1e-4 and "reward/ndcg" in metrics
