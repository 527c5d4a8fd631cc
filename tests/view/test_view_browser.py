"""grouprl view as a user sees it: a real two-step run of the VLM search agent (searching page
images of the slides task and cropping them, graded by a judge on a fake OpenAI-compatible
server), two held-out evaluations, the viewer serving them, and headless Chromium (Debian's
package, driven by playwright) reading what the page drew: the reward curve's points, a
trajectory's turns, its page image and crop box, the judge's reply, the two evaluations side by
side. The run is made twice: on a tiny random Idefics3 and on the embedded VLM
(`builtin:smolvlm-smollm2-135m`, SmolLM2-135M with a random vision tower). A screenshot of each
view is saved (to $GROUPRL_VIEW_SCREENSHOTS when set, from the embedded VLM's run: that is how
docs/view_*.png are made)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml
from PIL import Image

from grouprl.config import load_config
from grouprl.retriever.index import build_index
from grouprl.retriever.service import BackgroundServer
from grouprl.rollout.gold import write_slides_task
from grouprl.trainer.trainer import Trainer
from grouprl.view.app import create_app
from grouprl.view.runs import open_runs
from retriever.sample_index import shared_embedder
from rewards.judges.fake_server import FakeJudgeServer, Reply
from vision_helpers import ForcedTurns, tiny_vlm

pytestmark = pytest.mark.slow
KEY = "view-test-key-never-shown"
BOX = [4, 2, 20, 12]  # inside the page as shown (32 x 16 to the tiny VLM, 64 x 32 to the embedded one)
EMBEDDED_VLM = "builtin:smolvlm-smollm2-135m"  # assembled once into ~/.cache/grouprl/models
# a turn's and an observation's tokens: the tiny tokenizer spells the <bbox> out in more tokens
# and shows a page in more image tokens; an observation counts its images, turn markers and last-turn note
# (91 tokens of the tiny tokenizer); the embedded VLM's real sizes are kept short (time)
SIZES = {"tiny": (32, 160), "embedded": (24, 64)}
MARKUP = 'reward/<a href="https://example.com/">link</a>'  # a metric key as a policy's reward name could make it


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def grade(call):  # every other call right, so the group's rewards differ
    return Reply(content=json.dumps({"correctness": call.number % 2}))


def make_run(root: Path, judge_url: str, monkeypatch, model: str) -> Path:
    files = write_slides_task(
        root / "data", 0, 4, 2, n_decks=2, slides_per_deck=(3, 3), two_slide_share=0.0,
        image_size=(112, 56), self_answer=True,
    )  # fmt: skip
    build_index(files.corpus, root / "index", embedder=shared_embedder(), mode="bm25")
    word = json.loads(files.corpus.read_text().splitlines()[0])["title"].split()[0]
    if model == "tiny":
        tiny_vlm("idefics3", root / "model", init_std=0.02, vision_init_std=0.2)
    tree = {
        "data": {"train_files": [str(files.train)], "val_files": [str(files.val)], "train_batch_size": 2,
                 "max_prompt_length": 1024},
        "model": {"path": str(root / "model") if model == "tiny" else EMBEDDED_VLM},
        "rollout": {"n_agent": 2, "max_response_length": SIZES[model][0], "temperature": 1.0},
        "agent": {"enabled": True, "retriever": {"index": str(root / "index")}, "tools": ["search", "bbox"],
                  "answer_generator": "none", "max_turns": 3, "max_observation_tokens": SIZES[model][1],
                  "system_prompt": "Act with <search>, <bbox> or <answer>."},
        "reward": {
            "judges": [{"name": "grader", "model": "fake-judge", "base_url": judge_url, "api_key_env": "VIEW_JUDGE_KEY",
                        "max_retries": 1, "backoff_base_s": 0.001, "cache_path": "", "fields": {"correctness": 1.0}, "scale": 1}],
            "components": [{"name": "judge", "function": "judge:grader", "weight": 0.8},
                           {"name": "format", "function": "agent_format", "weight": 0.2}],
            "val_metric": "judge"},
        "actor": {"micro_batch_size": 4, "dtype": "float32"},
        "trainer": {"total_steps": 2, "device": "cpu", "output_dir": str(root / "runs"), "experiment_name": "vlm_agent",
                    "loggers": ["jsonl"], "test_freq": 0, "save_freq": 0, "save_final": False, "save_best": False, "save_last": False,
                    "val_before_train": False, "seed": 0},
    }  # fmt: skip
    (root / "config.yaml").write_text(yaml.safe_dump(tree, sort_keys=False))
    monkeypatch.setenv("VIEW_JUDGE_KEY", KEY)
    trainer = Trainer(load_config(str(root / "config.yaml"), []))
    ForcedTurns(trainer.parts.tokenizer, [f"<search>{word}</search>", f"<bbox>{BOX}</bbox>"]).install(monkeypatch)
    run = trainer.parts.run_dir
    trainer.evaluate(answers=run / "eval_start")  # before training, then after: two evaluations
    before_training = trainer.evaluate
    # fit's own last evaluation (its judge closes with it) writes what `grouprl eval` writes
    monkeypatch.setattr(trainer, "evaluate", lambda answers=None, progress=None: before_training(run / "eval", progress))
    trainer.fit()
    return run


@pytest.mark.parametrize("model", ["tiny", "embedded"])
def test_a_user_sees_the_vlm_agent_run_in_a_browser(tmp_path, monkeypatch, model):
    if chromium() is None:  # a missing browser is a failure, not a skip: the page is what is tested
        pytest.fail("no chromium on PATH: `make browser` (part of `make test`) installs Debian's package")
    from playwright.sync_api import sync_playwright

    docs = os.environ.get("GROUPRL_VIEW_SCREENSHOTS") if model == "embedded" else None
    shots = Path(docs or tmp_path / "shots")
    shots.mkdir(parents=True, exist_ok=True)
    with FakeJudgeServer(behaviour=grade).start() as judge:
        run = make_run(tmp_path, judge.base_url, monkeypatch, model)
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rewards = [(m["step"], m["reward/mean"]) for m in metrics if "reward/mean" in m]
    records = [json.loads(x) for x in (run / "rollouts.jsonl").read_text().splitlines()]
    assert [s for s, _ in rewards] == [1, 2] and len(records) == 2 * 2 * 2
    first = records[0]
    assert [t["action"] for t in first["turns"]][:2] == ["search", "bbox"]
    page = first["turns"][1]["page"]  # the page the crop cut from, copied into the run
    assert page.startswith("images/pages/") and (run / page).is_file() and first["turns"][0]["page"] == page
    # the size the processor showed the page at, which the <bbox> is pixels of, on both turns
    assert first["turns"][0]["page_size"] == first["turns"][1]["page_size"] != [112, 56]
    judged = [json.loads(x) for x in (run / "judge.jsonl").read_text().splitlines()]
    reply = [j["raw"] for j in judged if j["request_id"] == f"{first['uid']}/{first['sample']}"][0]

    # a metric key with markup (plotly reads <a href> in titles): drawn as its text, never a link
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 2, MARKUP: 1.0}) + "\n")
    with open(run / "rollouts.jsonl", "ab") as f:  # a line cut short: skipped, counted and said
        f.write(b'{"run": "vlm_agent", "step": 2, "uid": "cut\n')
    with BackgroundServer(create_app(open_runs([str(run)]))) as server, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium(), headless=True, args=["--no-sandbox"])
        view = browser.new_page(viewport={"width": 1280, "height": 900})
        errors = []
        view.on("pageerror", lambda error: errors.append(str(error)))
        view.add_init_script(
            "window.violations = []; document.addEventListener('securitypolicyviolation', (e) =>"
            " window.violations.push([e.violatedDirective, (e.sample || '').slice(0, 40)]));"
        )
        view.goto(server.url + "/")
        view.wait_for_selector("body[data-ready='1']", timeout=30_000)

        # curves: one point per step, at the logged values; the step's time split as stacked bars
        drawn = view.evaluate("(() => { const d = document.getElementById('plot-reward/mean').data[0]; return [d.x, d.y]; })()")
        assert drawn[0] == [s for s, _ in rewards] and drawn[1] == pytest.approx([r for _, r in rewards], abs=1e-12)
        assert view.locator("[id='plot-reward/mean'] .scatterlayer .point").count() == 2
        assert view.locator("[id='plot-time-vlm_agent'] .barlayer .point").count() >= 2 * 2
        titles = view.evaluate("[...document.querySelectorAll('.plot .gtitle')].map(t => t.textContent)")
        assert MARKUP in titles and view.locator(".plot svg a").count() == 0
        view.evaluate(f"document.getElementById({json.dumps('plot-' + MARKUP)}).remove()")  # out of the screenshot
        assert view.locator("#unreadable").inner_text() == "vlm_agent: 1 line unreadable (rollouts.jsonl 1), skipped"
        view.evaluate("document.getElementById('unreadable').textContent = ''")  # the docs' figures show a clean run
        view.screenshot(path=str(shots / "view_curves.png"))

        # trajectories: step 1's groups, then the first sample's turns, page, crop and judge reply
        view.click("button[data-view='trajectories']")
        view.wait_for_selector(".sample-row")
        assert view.locator("#traj-step option").all_inner_texts() == ["1", "2"]
        assert view.locator(".group").count() == 2 and view.locator(".sample-row").count() == 4
        view.screenshot(path=str(shots / "view_trajectories.png"))
        # the filters: zero-variance groups only, then samples of reward 0.5 or more, as step 1's records say
        step1 = [r for r in records if r["step"] == 1]
        uids = {r["uid"] for r in step1}
        flat = sum(len({r["reward"] for r in step1 if r["uid"] == u}) == 1 for u in uids)
        view.check("#only-zero-variance")
        assert view.locator(".group").count() == flat
        assert view.locator("#groups .note").count() == (flat == 0)  # "No group passes the filters."
        view.uncheck("#only-zero-variance")
        view.fill("#reward-min", "0.5")
        high = [r for r in step1 if r["reward"] >= 0.5]
        assert 0 < len(high) < 4 and view.locator(".sample-row").count() == len(high)
        assert view.locator(".group").count() == len({r["uid"] for r in high})
        view.fill("#reward-min", "")
        assert view.locator(".group").count() == 2 and view.locator(".sample-row").count() == 4
        view.locator(".sample-row").first.click()
        view.wait_for_selector("#turns .turn")
        assert view.locator("#turns .turn").count() == len(first["turns"])
        assert "<search>" in view.locator("#turns .turn .bubble.policy").first.inner_text()
        view.wait_for_function("[...document.querySelectorAll('img.page')].every(i => i.complete && i.naturalWidth > 0)")
        natural = view.evaluate("[...document.querySelectorAll('img.page')].map(i => [i.naturalWidth, i.naturalHeight])")
        assert natural == [[112, 56], [112, 56]]  # the search's page, then the page the crop cut from
        box = view.locator(".crop-box")
        assert box.count() == 1
        width, height = first["turns"][1]["page_size"]  # the page as the policy saw it: the box's pixels
        style = dict(part.strip().split(": ") for part in box.get_attribute("style").rstrip(";").split(";"))  # set through the CSSOM
        drawn = [float(style[k].rstrip("%")) for k in ("left", "top", "width", "height")]
        x1, y1, x2, y2 = BOX
        assert drawn == pytest.approx([x1 / width * 100, y1 / height * 100, (x2 - x1) / width * 100, (y2 - y1) / height * 100])
        assert view.evaluate("document.querySelector('canvas.crop').width") > 0
        assert view.locator(".judge-raw").first.inner_text() == reply
        assert "null" not in view.locator("#sample").inner_text()  # nothing empty spelled out
        view.evaluate("document.getElementById('sample').style.maxHeight = 'none'")  # all of it, judge included
        view.locator("#sample").screenshot(path=str(shots / "view_sample.png"))

        # held-out: the two evaluations side by side, paired by uid
        view.click("button[data-view='heldout']")
        view.select_option("#eval-a", "vlm_agent|eval")
        view.select_option("#eval-b", "vlm_agent|eval_start")
        view.wait_for_selector(".answer-row", timeout=5_000) if not errors else None
        assert not errors, errors
        assert view.locator(".answer-row").count() == 2
        assert "2 paired by uid" in view.locator("#eval-summary").inner_text()
        view.screenshot(path=str(shots / "view_heldout.png"))
        assert KEY not in view.content() and not errors
        # the Content-Security-Policy held everything the page does; the one sheet refused is
        # plotly's for map traces (maplibre), which the page never draws
        violations = view.evaluate("window.violations")
        assert all(v == ["style-src-elem", ".maplibregl-map{font:12px/20px Helvetica"] for v in violations), violations
        browser.close()
    if docs:  # the README's figures: 128 colours keep each under about 60 KB
        for shot in shots.glob("view_*.png"):
            Image.open(shot).convert("RGB").quantize(colors=128, method=Image.Quantize.MEDIANCUT).save(shot, optimize=True)
