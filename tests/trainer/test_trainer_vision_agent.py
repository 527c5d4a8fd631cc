"""A VLM policy in the multi-turn agent loop inside the training loop: the built-in slides task
(page images drawn with Pillow), a real in-process index, the search tool showing the first
hit's page, `<bbox>` cropping it, and an update over trajectories that carry both image
observations. A tiny random policy never writes an action, so its first two turns are forced
(the engine draws the scripted token instead of a sampled one and still reports the model's
log-prob of it); the third turn is sampled. `rollout.check_log_probs` then compares, every
step, the update's log-prob of every policy token (after two image observations) with what
generation computed: equal only when the update's forward sees the same pages and crops at the
same positions."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image
from tiny import LOWER_FRACTION, write_reward
from vision_task import write_vision_run

from grouprl.config import load_config
from grouprl.retriever.index import build_index
from grouprl.rollout.agent import AgentLoop
from grouprl.rollout.gold import write_slides_task
from grouprl.trainer.trainer import Trainer
from retriever.sample_index import shared_embedder
from vision_helpers import ForcedTurns

BOX = "<bbox>[0, 0, 20, 20]</bbox>"


@pytest.fixture(scope="module")
def slides(tmp_path_factory):
    """(task files, a word of the first slide's title): 2 decks of small pages, BM25-searchable."""
    folder = tmp_path_factory.mktemp("slides")
    files = write_slides_task(
        folder / "data", 0, 4, 2, n_decks=2, slides_per_deck=(3, 3), two_slide_share=0.0,
        image_size=(112, 56), self_answer=True,
    )
    build_index(files.corpus, folder / "index", embedder=shared_embedder(), mode="bm25")
    first = json.loads(files.corpus.read_text().splitlines()[0])
    return files, folder / "index", first["title"].split()[0]


def agent_trainer(tmp_path, family, slides, monkeypatch, *overrides):
    files, index, word = slides
    reward = write_reward(tmp_path / "lower.py", LOWER_FRACTION, "score")
    config = write_vision_run(tmp_path, family, vision_init_std=0.2)
    trainer = Trainer(load_config(config, [
        f"data.train_files=[{files.train}]", "data.val_files=[]", "data.max_prompt_length=1024",
        "agent.enabled=true", f"agent.retriever.index={index}", "agent.tools=[search, bbox]",
        "agent.answer_generator=none", "agent.max_turns=3", "agent.max_observation_tokens=160",
        "agent.system_prompt='Act with <search>, <bbox> or <answer>.'",
        "rollout.max_response_length=32", "rollout.check_log_probs=true", "rollout.n_agent=3",
        f"reward.components=[{{name: lower, function: '{reward}'}}]", "reward.val_metric=lower",
        "trainer.save_final=false", "trainer.save_best=false", "trainer.test_freq=0", *overrides,
    ]))
    ForcedTurns(trainer.parts.tokenizer, [f"<search>{word}</search>", BOX]).install(monkeypatch)
    return trainer


@pytest.mark.parametrize("family", ["qwen2_vl", "idefics3"])
def test_a_vlm_search_agent_trains_on_page_images_and_crops(tmp_path, family, slides, monkeypatch):
    trainer = agent_trainer(tmp_path, family, slides, monkeypatch, "trainer.total_steps=2", "data.image_max_pixels=6272")
    assert isinstance(trainer.parts.collect.runner, AgentLoop) and trainer.parts.vision is not None
    # the pixel cap of the data's images reaches the tools: the pages a search shows, the crops
    assert trainer.parts.collect.runner.tools["search"].max_pixels == trainer.parts.collect.runner.tools["bbox"].max_pixels == 112 * 56
    before = {n: p.detach().clone() for n, p in trainer.parts.learn.model.named_parameters() if p.requires_grad}
    metrics, trajectories, _ = trainer.train_step()
    image_token = trainer.parts.vision.family.image_token_id
    for t in trajectories:
        assert [r["action"] for r in t.turns][:2] == ["search", "bbox"]
        page, crop = t.response_images  # the first hit's page, then the crop of it
        assert page.original_size == (112, 56)
        sx, sy = page.original_size[0] / page.shown_size[0], page.original_size[1] / page.shown_size[1]
        assert crop.original_size == (min(112, -(-20 * sx // 1)), min(56, -(-20 * sy // 1)))
        # image tokens only in observations (loss mask 0), one image's worth per observation image
        in_response = [m for i, m in zip(t.response_ids, t.loss_mask) if i == image_token]
        assert len(in_response) == page.num_tokens + crop.num_tokens and not any(in_response)
    # the update scored every policy token as generation did, after both image observations
    assert metrics["rollout/mismatch_max"] < 1e-5, metrics["rollout/mismatch_max"]
    assert metrics["adv/max"] > 0 and metrics["actor/grad_norm"] > 0
    moved = [n for n, p in trainer.parts.learn.model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert moved
    trainer.fit()  # step 2 runs the same way through fit
    run = tmp_path / "runs" / "run"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["rollout/mismatch_max"] < 1e-5) for r in rows if "rollout/mismatch_max" in r] == [(2, True)]
    records = [json.loads(x) for x in (run / "rollouts.jsonl").read_text().splitlines()]
    assert {r["step"] for r in records} == {2} and len(records) == 2 * 3
    for r in records:  # step 2 searched and cropped too: one image after each of its first two turns
        assert [(t["action"], t["images"]) for t in r["turns"][:2]] == [("search", 1), ("bbox", 1)]


@pytest.mark.parametrize("family", ["qwen2_vl", "idefics3"])
@pytest.mark.parametrize("blanked", [0, 1], ids=["page", "crop"])
def test_the_update_sees_the_observation_images(tmp_path, slides, monkeypatch, family, blanked):
    """The check is sharp for each observation image: an update that shows a blank image in place
    of the retrieved page, or of the crop (images sliced or dropped between rollout and
    training), scores the policy's tokens differently."""
    import grouprl.trainer.update as update

    trainer = agent_trainer(tmp_path, family, slides, monkeypatch, "trainer.total_steps=1")
    real = update.build_step_tensors

    def blind(trajectories, *args, **kwargs):
        tensors = real(trajectories, *args, **kwargs)
        for row in tensors.response_images:
            shown = row[blanked]
            row[blanked] = trainer.parts.vision.prepare_image(Image.new("RGB", shown.original_size))
            assert row[blanked].num_tokens == shown.num_tokens  # only the pixels differ
        return tensors

    monkeypatch.setattr("grouprl.trainer.learner.build_step_tensors", blind)
    metrics, _, _ = trainer.train_step()
    assert metrics["rollout/mismatch_max"] > 1e-4  # exact: below 1e-5 (the test above)
