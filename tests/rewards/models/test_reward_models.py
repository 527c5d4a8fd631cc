"""Reward models in their worker process: a tiny sequence classifier saved to a folder and
loaded by path (the real from_pretrained path), scores equal to the model run in the test,
batching of concurrent items, one line when a model cannot load, and a worker that dies
giving fallbacks (counted) instead of a hang. Workers fork from a server that may have started
before the environment changed: they take the environment of their own start."""

import logging
from pathlib import Path

import pytest
import torch

from grouprl.config import RewardComponentConfig, RewardConfig, RewardModelConfig
from grouprl.data.sample import Sample
from grouprl.errors import ConfigError, UserError
from grouprl.processes import start_server
from grouprl.rewards import CompositeReward
from grouprl.rewards.models.client import PRELOAD
from grouprl.rollout.trajectory import Trajectory
from helpers import char_tokenizer, tiny_config
from rewards.models.tiny_image_models import tiny_clip_dir, tiny_pipeline_dir


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory):
    from transformers import AutoModelForSequenceClassification

    folder = tmp_path_factory.mktemp("rm")
    tokenizer = char_tokenizer()
    config = tiny_config("llama", vocab_size=len(tokenizer), num_labels=1, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def classifier_config(path, **model):
    return RewardConfig(
        models=[RewardModelConfig(name="rm", kind="sequence_classifier", path=str(path), **model)],
        components=[RewardComponentConfig(name="preference", function="model:rm")],
    )


def trajectories(prompt_response_pairs):
    out = []
    for i, (prompt, response) in enumerate(prompt_response_pairs):
        sample = Sample(uid=f"u{i // 2}", messages=[{"role": "user", "content": prompt}])
        out.append(Trajectory(sample=sample, index=i % 2, prompt_ids=[1], response_text=response))
    return out


def reference_scores(path, pairs):
    """The classifier's logit for each (prompt, response), computed here one at a time."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    scores = []
    for prompt, response in pairs:
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            scores.append(float(model(**ids).logits[0, 0]))
    return scores


PAIRS = [("hi", "hello there"), ("hi", "go away"), ("2+2?", "4"), ("2+2?", "five"), ("x", "y"), ("x", "")]


@pytest.mark.slow
def test_a_sequence_classifier_scores_in_its_worker_batched(classifier_dir):
    reward = CompositeReward.from_config(classifier_config(classifier_dir, batch_size=4))
    try:
        batch = trajectories(PAIRS)
        metrics = reward.score(batch)
        # padded batches (left or right) give each item the logit it has alone
        want = reference_scores(classifier_dir, PAIRS)
        assert [t.rewards["preference"] for t in batch] == pytest.approx(want, abs=1e-5)
        assert len({round(w, 4) for w in want}) == len(want)  # distinct: a mix-up would show
        assert metrics["reward/errors"] == 0
        steps = reward.step_metrics()
        assert steps["reward_model/rm/items"] == 6 and steps["reward_model/rm/batches"] == 2  # 4 + 2
        assert steps["reward_model/rm/queue_max"] == 6 and steps["reward_model/rm/busy_s"] > 0
        assert reward.step_metrics()["reward_model/rm/items"] == 0  # counted once
    finally:
        reward.close()


def test_a_model_that_cannot_load_is_one_line(tmp_path):
    with pytest.raises(UserError, match=r"reward models \(rm\) failed to load: \w+Error: .*nowhere"):
        CompositeReward.from_config(classifier_config(tmp_path / "nowhere"))


def test_reward_model_references_are_checked_before_anything_loads():
    with pytest.raises(ConfigError, match="uses model 'judge', but reward.models defines rm"):
        RewardConfig(
            models=[RewardModelConfig(name="rm", kind="sequence_classifier", path="x")],
            components=[RewardComponentConfig(name="c", function="model:judge")],
        )
    with pytest.raises(ConfigError, match="needs images_from: the model drawing the images"):
        RewardConfig(models=[RewardModelConfig(name="clip", kind="clip", path="x")])
    with pytest.raises(ConfigError, match="model 'draw' draws images and gives no score"):
        RewardConfig(
            models=[RewardModelConfig(name="draw", kind="scene_renderer")],
            components=[RewardComponentConfig(name="c", function="model:draw")],
        )


def test_a_worker_that_dies_gives_fallbacks_not_a_hang(classifier_dir, caplog):
    config = classifier_config(classifier_dir)
    config.fallback = -1.0
    reward = CompositeReward.from_config(config)
    try:
        reward.models._process.kill()
        reward.models._process.join(timeout=10)
        batch = trajectories(PAIRS[:2])
        with caplog.at_level(logging.WARNING):
            metrics = reward.score(batch)
        assert [t.reward for t in batch] == [-1.0, -1.0]
        assert metrics["reward/errors"] == 2
        assert "the reward-model worker exited" in caplog.text
        later = trajectories(PAIRS[2:4])
        reward.score(later)  # fails at once from now on
        assert [t.reward for t in later] == [-1.0, -1.0]
    finally:
        reward.close()


# ------------------------------------------------------------------ text-to-image -> CLIP
@pytest.fixture(scope="module")
def image_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("image-models")
    return tiny_pipeline_dir(root / "sd"), tiny_clip_dir(root / "clip")


def image_reward_config(pipeline, clip, cache):
    return RewardConfig(
        models=[
            RewardModelConfig(
                name="t2i", kind="text_to_image", path=str(pipeline), steps=2, height=16, width=16,
                batch_size=2, seed=5, cache_dir=str(cache),
            ),
            RewardModelConfig(name="clip", kind="clip", path=str(clip), images_from="t2i", batch_size=4),
        ],
        components=[RewardComponentConfig(name="clip", function="model:clip")],
    )  # fmt: skip


@pytest.mark.slow
def test_text_to_image_then_clip_scores_the_response_drawing_against_the_request(image_models, tmp_path):
    import zlib

    import numpy as np
    from diffusers import DiffusionPipeline
    from PIL import Image
    from transformers import AutoModel, AutoProcessor

    pipeline, clip = image_models
    reward = CompositeReward.from_config(image_reward_config(pipeline, clip, tmp_path / "cache"))
    pairs = [("a cat", "a red circle"), ("a cat", "a blue square"), ("a dog", "a red circle"), ("a dog", "a red circle")]
    batch = trajectories(pairs)
    try:
        metrics = reward.score(batch)
        assert metrics["reward/errors"] == 0
        paths = [t.artifacts["clip"] for t in batch]
        # one group, one seed: the same response gives the same image; another group, another seed
        assert paths[2] == paths[3] and len(set(paths)) == 3
        assert len(list((tmp_path / "cache").rglob("*.png"))) == 3  # drawn once, cached
        steps = reward.step_metrics()
        assert steps["reward_model/clip/items"] == 4 and steps["reward_model/clip/batches"] == 1

        # the image is the pipeline's for that prompt and seed, the score CLIP's cosine with the request
        pipe = DiffusionPipeline.from_pretrained(pipeline)
        pipe.set_progress_bar_config(disable=True)
        model, processor = AutoModel.from_pretrained(clip).eval(), AutoProcessor.from_pretrained(clip)
        for t, (request, response) in zip(batch, pairs):
            seed = (5 + zlib.crc32(t.uid.encode())) % 2**31
            want = pipe(
                prompt=[response], num_inference_steps=2, guidance_scale=7.0, height=16, width=16,
                generator=[torch.Generator().manual_seed(seed)],
            ).images[0]  # fmt: skip
            got = Image.open(t.artifacts["clip"]).convert("RGB")
            # the worker drew the prompts in a batch of two, this one alone: the same image up to
            # float reordering, which can move a pixel across a rounding step (one level of 255)
            assert np.abs(np.asarray(got).astype(int) - np.asarray(want).astype(int)).max() <= 1
            inputs = processor(text=[request], images=[got], return_tensors="pt", padding=True)
            with torch.no_grad():
                out = model(**inputs)
            assert t.rewards["clip"] == pytest.approx(float((out.image_embeds * out.text_embeds).sum()), abs=1e-5)

        # scored again: every image comes from the cache (no file rewritten)
        stamps = {p: Path(p).stat().st_mtime_ns for p in paths}
        again = trajectories(pairs)
        reward.score(again)
        assert [t.rewards["clip"] for t in again] == [t.rewards["clip"] for t in batch]
        assert {p: Path(p).stat().st_mtime_ns for p in paths} == stamps
    finally:
        reward.close()


def test_drawn_images_go_to_the_run_folder_beside_their_rewards(tmp_path):
    import json

    from grouprl.trainer.loggers import RolloutWriter

    source = tmp_path / "cache" / "ab.png"
    source.parent.mkdir()
    source.write_bytes(b"png bytes")
    (t,) = trajectories([("a cat", "a red circle")])
    t.artifacts["clip"] = str(source)
    t.rewards["clip"] = 0.5
    (line,) = RolloutWriter.lines("run", 3, [t], {}, tmp_path / "run" / "images")
    record = json.loads(line)
    assert record["images"] == {"clip": "images/step_3/u0_0_clip.png"}
    assert (tmp_path / "run" / record["images"]["clip"]).read_bytes() == b"png bytes"


# ------------------------------------------------------------------ an image service over HTTP
class FakeImageService:
    """POST /v1/images/generations (OpenAI images API shape) on 127.0.0.1: a solid colour per
    (prompt, seed); a prompt's first request is answered 429 (Retry-After: 0), the prompt
    "explode" always 500 with the key in the body (it must not reach a message)."""

    def __init__(self, key):
        import http.server
        import threading

        service = self
        self.key, self.requests, self.seen = key, [], set()

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                import base64
                import io
                import json

                from PIL import Image

                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                service.requests.append((self.path, self.headers.get("Authorization"), body))
                prompt = body["prompt"]
                if prompt == "explode":
                    return self.reply(500, {"error": f"bad key {service.key}?"})
                if prompt not in service.seen:
                    service.seen.add(prompt)
                    return self.reply(429, {"error": "slow down"}, {"Retry-After": "0"})
                colour = tuple((hash(prompt) + body["seed"] * k) % 256 for k in (1, 3, 7))
                buffer = io.BytesIO()
                width, height = map(int, body["size"].split("x"))
                Image.new("RGB", (width, height), colour).save(buffer, format="PNG")
                self.reply(200, {"data": [{"b64_json": base64.b64encode(buffer.getvalue()).decode()}]})

            def reply(self, status, payload, headers=None):
                import json

                data = json.dumps(payload).encode()
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.slow
def test_an_image_service_draws_with_retries_and_a_failing_sample_falls_back(image_models, tmp_path, monkeypatch, caplog):
    _, clip = image_models
    start_server(PRELOAD)  # the worker's server started before the key is set: the worker still reads it
    monkeypatch.setenv("IMAGE_KEY", "sk-secret-123")
    service = FakeImageService("sk-secret-123")
    config = RewardConfig(
        models=[
            RewardModelConfig(
                name="api", kind="http_image", path="image-model-1", base_url=service.base_url,
                api_key_env="IMAGE_KEY", height=16, width=16, batch_size=4, cache_dir=str(tmp_path / "cache"),
                max_retries=1,  # one retry takes the 429 (0.5 s of backoff); the 500 sample then falls back
            ),
            RewardModelConfig(name="clip", kind="clip", path=str(clip), images_from="api"),
        ],
        components=[RewardComponentConfig(name="clip", function="model:clip")],
        fallback=-1.0,
    )  # fmt: skip
    reward = CompositeReward.from_config(config)
    try:
        batch = trajectories([("a cat", "a red circle"), ("a cat", "explode"), ("a dog", "a blue square")])
        with caplog.at_level(logging.WARNING):
            metrics = reward.score(batch)
    finally:
        reward.close()
        service.close()
    assert metrics["reward/errors"] == 1 and batch[1].reward == -1.0  # the bad sample alone falls back
    assert batch[0].reward != -1.0 and batch[2].reward != -1.0 and "clip" in batch[0].artifacts
    path, auth, body = service.requests[-1]
    assert path == "/v1/images/generations" and auth == "Bearer sk-secret-123"
    assert body["model"] == "image-model-1" and body["size"] == "16x16" and body["response_format"] == "b64_json"
    tries = [b["prompt"] for _, _, b in service.requests]
    assert tries.count("a red circle") == 2  # 429 first, then the image
    assert "HTTP 500" in caplog.text and "sk-secret-123" not in caplog.text


@pytest.mark.slow
def test_model_rewards_score_groups_while_generation_goes_on(classifier_dir):
    """The streaming path: groups submitted as they finish are scored by the worker while the
    caller keeps "generating" (sleeping here); little is left to wait for at the end."""
    import time

    from grouprl.rewards.streaming import StreamingRewards

    reward = CompositeReward.from_config(classifier_config(classifier_dir))
    streaming = StreamingRewards(reward)
    try:
        groups = [trajectories(PAIRS)[k : k + 2] for k in (0, 2, 4)]
        start = time.perf_counter()
        for group in groups:
            time.sleep(0.3)  # the next group is still generating
            streaming.submit(group)
        finished = streaming.finish(generation_end=time.perf_counter())
        assert time.perf_counter() - start < 0.9 + 0.5
        assert finished.hidden_s > 0.0 and finished.reward_s < 0.3
        assert finished.metrics["reward/errors"] == 0
        want = reference_scores(classifier_dir, PAIRS)
        assert [t.rewards["preference"] for g in groups for t in g] == pytest.approx(want, abs=1e-5)
        assert reward.step_metrics()["reward_model/rm/batches"] == 3  # one per group, as it came
    finally:
        streaming.close()
        reward.close()


def test_a_cancelled_caller_does_not_stop_the_pool(classifier_dir):
    """An interrupted step cancels its futures; the answers that arrive later are dropped and
    the next items are still scored."""
    reward = CompositeReward.from_config(classifier_config(classifier_dir))
    try:
        pool = reward.models
        abandoned = [pool.submit("rm", {"prompt": "hi", "response": r}) for r in ("a", "b", "c")]
        for future in abandoned:
            future.cancel()
        later = pool.submit("rm", {"prompt": "hi", "response": "hello there"})
        assert later.result(timeout=60) == pytest.approx(reference_scores(classifier_dir, [PAIRS[0]])[0], abs=1e-5)
        assert pool._dead is None and pool._thread.is_alive()
    finally:
        reward.close()
