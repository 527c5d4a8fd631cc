"""The agent loop with a VLM policy: a search shows a page image, <bbox> crops it in the
coordinates of the image as the processor resized it, and both images come back as image
observations (loss mask 0) that the session is fed and the update scores. The policy's turns
are scripted (a tiny random model would never write an action); the tokens and images it is fed
are recorded and checked, then the trajectories go through the update's log-probs against
transformers' own forward of each whole trajectory."""

import pytest
import torch
from PIL import Image

from grouprl.config import AgentConfig
from grouprl.data.sample import Sample
from grouprl.rollout.agent import AgentLoop
from grouprl.rollout.engines import Generation, SamplingParams
from grouprl.rollout.engines.base import TurnsAtEachStep
from grouprl.rollout.tools.base import Observation
from grouprl.rollout.tools.crop import CropTool
from grouprl.trainer.logprobs import response_log_probs
from grouprl.trainer.update import build_step_tensors
from helpers import exact_float64_norms
from vision_helpers import tiny_vlm

PAGE = (112, 56)  # left half red, right half blue; shown to the tiny Qwen-VL as 56 x 28


class ScriptedVisionEngine:
    """Turns come from `script(turn)`; sessions record what the loop feeds each row."""

    device = torch.device("cpu")

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script = tokenizer, script
        self.prefill_tokens = 0
        self.feeds: dict[int, list[tuple[list[int], list]]] = {}

    def open_session(self, prompts, n, reuse_cache=True, images=None):
        engine = self

        class Session(TurnsAtEachStep):
            turns = [0] * (len(prompts) * n)

            def generate(self, rows, new_tokens, params, generator=None, new_images=None):
                out = []
                for k, row in enumerate(rows):
                    engine.feeds.setdefault(row, []).append((list(new_tokens[k]), list(new_images[k]) if new_images else []))
                    text = engine.script(self.turns[row])
                    self.turns[row] += 1
                    ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
                    out.append(Generation(ids, text, "stop"))
                return out

            def release(self, row):
                self.forget(row)

        return Session()


class PageSearch:
    """Shows one page image, as grouprl's search tool does: the hit's image becomes the current
    image, at its original size until the loop says how the policy sees it."""

    name = "search"

    def __init__(self, path):
        self.path = path

    async def __call__(self, argument, state):
        state.add_hits([{"id": "p1", "score": 1.0, "text": "", "image": str(self.path)}])
        state.current_image, state.current_image_size = str(self.path), PAGE
        return Observation("page p1", images=[str(self.path)])


def script(turn):
    # the left half of the page as the policy sees it (56 x 28): [0, 0, 28, 28]
    return ["<search>colours</search>", "<bbox>[0, 0, 28, 28]</bbox>", "<answer>red</answer>"][turn]


@pytest.fixture
def page(tmp_path):
    image = Image.new("RGB", PAGE, (0, 0, 230))
    image.paste((230, 0, 0), (0, 0, PAGE[0] // 2, PAGE[1]))
    path = tmp_path / "page.png"
    image.save(path)
    return path


def test_image_observations_are_masked_fed_and_scored(page):
    model, tokenizer, vision = tiny_vlm("qwen2_vl", dtype=torch.float64)
    model = exact_float64_norms(model)
    engine = ScriptedVisionEngine(tokenizer, script)
    cfg = AgentConfig(answer_generator="none", max_turns=4, max_observation_tokens=0)
    loop = AgentLoop(engine, tokenizer, {"search": PageSearch(page), "bbox": CropTool()}, cfg, vision=vision)
    sample = Sample(uid="s", messages=[{"role": "user", "content": "<image> Which colour is on the left?"}])
    prompt, prompt_images = vision.encode(loop_messages(loop, sample), [Image.new("RGB", (56, 56), (0, 200, 0))])
    trajectories = loop.run([sample], [prompt], 2, SamplingParams(max_new_tokens=40), images=[prompt_images])

    for row, t in enumerate(trajectories):
        assert t.finish_reason == "answer" and [r["action"] for r in t.turns] == ["search", "bbox", "answer"]
        page_image, crop = t.response_images
        assert page_image.shown_size == (56, 28) and page_image.original_size == PAGE
        # the crop is the left half of the original page: the policy's box was in shown pixels
        assert crop.original_size == (56, 56)
        # the turn records name the page shown, then cropped, at the size the policy saw it
        assert [(r["text"], r.get("page"), r.get("page_size")) for r in t.turns] == [
            (script(0), str(page), [56, 28]), (script(1), str(page), [56, 28]), (script(2), None, None),
        ]  # fmt: skip
        assert t.prompt_images == prompt_images
        # what the session was fed: nothing on turn 1, then each observation with its image
        feeds = engine.feeds[row]
        assert feeds[0] == ([], []) and [images for _, images in feeds[1:]] == [[page_image], [crop]]
        # masks: policy turns are 1, each observation (its image tokens included) is 0
        spans = runs(t.response_ids, t.loss_mask)
        assert [mask for mask, _ in spans] == [1, 0, 1, 0, 1]
        assert [tokenizer.decode(ids) for mask, ids in spans if mask] == [script(0), script(1), script(2)]
        for (_, ids), image, fed in zip([s for s in spans if not s[0]], [page_image, crop], feeds[1:]):
            text = tokenizer.decode(ids)
            assert text.count("<|image_pad|>") == image.num_tokens and text.count("<|vision_start|>") == 1
            assert ids == fed[0]  # the tokens fed are the tokens kept
        assert not any(i == vision.family.image_token_id for i, m in zip(t.response_ids, t.loss_mask) if m)
    crop_pixels = trajectories[0].response_images[1].tensors["pixel_values"]
    page_crop = vision.prepare_image(Image.new("RGB", (56, 56), (230, 0, 0)))
    assert torch.equal(crop_pixels, page_crop.tensors["pixel_values"])  # all red: the left half

    # the update scores these trajectories as the model's own forward over each whole trajectory
    tensors = build_step_tensors(trajectories, "cpu", mask_truncated=False, pad_token_id=0)
    with torch.no_grad():
        got, _ = response_log_probs(model, tensors.rows([0, 1]), temperature=0.8, vision=vision.family)
        for i, t in enumerate(trajectories):
            ids = torch.tensor([t.prompt_ids + t.response_ids])
            images = t.prompt_images + t.response_images
            logits = model(
                input_ids=ids,
                pixel_values=torch.cat([im.tensors["pixel_values"] for im in images]),
                image_grid_thw=torch.cat([im.tensors["image_grid_thw"] for im in images]),
                mm_token_type_ids=(ids == vision.family.image_token_id).int(),
            ).logits[0].double() / 0.8
            logits[:, vision.family.never_sampled()] = float("-inf")
            p = len(t.prompt_ids)
            want = torch.log_softmax(logits[p - 1 : -1], -1).gather(-1, ids[0, p:, None]).squeeze(-1)
            policy = torch.tensor(t.loss_mask).bool()
            torch.testing.assert_close(got[i, : len(t.response_ids)][policy], want[policy], rtol=0, atol=1e-10)


def loop_messages(loop, sample):
    from grouprl.rollout.agent_prompts import with_protocol

    return with_protocol(sample.messages, loop.system_prompt)


def runs(ids, mask):
    """[(mask value, token ids)] of the maximal runs of equal mask."""
    out = []
    for token, m in zip(ids, mask):
        if out and out[-1][0] == m:
            out[-1][1].append(token)
        else:
            out.append((m, [token]))
    return out


def test_a_text_policy_reads_the_observation_text_only(page):
    """Without a VLM the loop shows the observation's text (its images are not the policy's)."""
    from helpers import char_tokenizer

    tokenizer = char_tokenizer()
    engine = ScriptedVisionEngine(tokenizer, script)
    loop = AgentLoop(engine, tokenizer, {"search": PageSearch(page), "bbox": CropTool()},
                     AgentConfig(answer_generator="none", max_turns=4))
    sample = Sample(uid="s", messages=[{"role": "user", "content": "Which colour?"}])
    prompt = loop.encode_prompts([sample])[0]
    (t,) = loop.run([sample], [prompt], 1, SamplingParams(max_new_tokens=40))
    assert t.response_images == [] and "<image>" not in t.response_text
    assert "page p1" in t.response_text and [images for _, images in engine.feeds[0]] == [[], [], []]


def test_an_observations_images_count_against_its_token_limit(tmp_path):
    """max_observation_tokens bounds the observation as fed, image tokens included: a 448 x 448
    page (256 image tokens and 2 markers on this tiny Qwen-VL) is processed again at fewer pixels
    (aspect kept) to fit the room the turn markers, the last-turn note and the text's share
    leave; the text gets the rest."""
    from grouprl.rollout.agent_prompts import LAST_TURN
    from grouprl.rollout.chat import ChatRenderer

    _, tokenizer, vision = tiny_vlm("qwen2_vl", max_pixels=448 * 448)
    path = tmp_path / "page.png"
    Image.new("RGB", (448, 448), (0, 0, 230)).save(path)
    assert vision.prepare_image(str(path)).num_tokens == 256
    least = len(ChatRenderer(tokenizer, "user").observation_ids("\n\n" + LAST_TURN["answer"])) + 1
    limit = least + 40
    engine = ScriptedVisionEngine(tokenizer, lambda turn: ["<search>a</search>", "<answer>b</answer>"][turn])
    cfg = AgentConfig(answer_generator="none", max_turns=2, max_observation_tokens=limit)

    class Search(PageSearch):
        async def __call__(self, argument, state):
            observation = await super().__call__(argument, state)
            state.current_image_size = (448, 448)
            return observation

    loop = AgentLoop(engine, tokenizer, {"search": Search(path)}, cfg, vision=vision)
    sample = Sample(uid="s", messages=[{"role": "user", "content": "Which colour?"}])
    (t,) = loop.run([sample], loop.encode_prompts([sample]), 1, SamplingParams(max_new_tokens=40))
    [shown] = t.response_images
    assert t.turns[0]["masked_tokens"] <= limit  # the last-turn note included (max_turns=2)
    assert 4 <= shown.num_tokens < 256 and shown.shown_size[0] == shown.shown_size[1] < 448
    assert t.turns[0]["page_size"] == list(shown.shown_size)
    assert "agent/errors/observation_images_left_out" not in loop.stats


def test_images_that_cannot_fit_are_left_out_last_first():
    """fit_images: shrunk to the budget where fewer pixels mean fewer tokens (Qwen), left out,
    last first, where they do not (a fixed size per image: Idefics3 without tiling)."""
    from grouprl.rollout.observation_fit import fit_images, image_tokens

    _, _, qwen = tiny_vlm("qwen2_vl", max_pixels=112 * 112)
    pages = [Image.new("RGB", (112, 112), (0, 0, 230)), Image.new("RGB", (112, 56), (230, 0, 0))]
    shown = [qwen.prepare_image(p) for p in pages]
    assert [image_tokens(qwen, im) for im in shown] == [18, 10]  # 16 and 8 image tokens, 2 markers each
    fitted = fit_images(qwen, pages, shown, 12)
    assert len(fitted) == 2 and sum(image_tokens(qwen, im) for im in fitted) <= 12
    assert [im.shown_size[0] / im.shown_size[1] for im in fitted] == [1.0, 2.0]  # aspect kept
    assert fit_images(qwen, pages, shown, 28) == shown  # within the budget: as they were
    assert fit_images(qwen, pages, shown, 2) == []

    _, _, idefics = tiny_vlm("idefics3")
    shown = [idefics.prepare_image(p) for p in pages]
    each = image_tokens(idefics, shown[0])
    assert image_tokens(idefics, idefics.prepare_image(pages[0].resize((8, 8)))) == each  # pixels do not matter
    assert fit_images(idefics, pages, shown, 2 * each - 1) == shown[:1]
