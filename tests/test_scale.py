"""benchmarks/scale.py at toy size (each family's shapes shrunk): a model folder built from the
published config with random weights, prompts of an exact length, responses to the length limit,
one `grouprl train` per model, and its table and figures (CI runs this; the real sizes run on a
GPU or, at 0.5B, on the CPU)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "scale.py"


@pytest.mark.slow
def test_the_toy_run_reports_each_family_with_fixed_lengths_and_planned_peaks(tmp_path):
    out = tmp_path / "scale.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--toy", "--work", str(tmp_path / "work"), "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| model | params | gen tok/s | upd tok/s | MFU |" in done.stdout
    figures = json.loads(out.read_text())["models"]
    assert sorted(figures) == ["toy-qwen2.5-0.5b", "toy-qwen2.5-vl-3b"]
    for name, f in figures.items():
        assert f["response_len"] == 32  # rollout.ignore_eos: every response at the limit
        assert f["gen_tok_s"] > 0 and f["upd_tok_s"] > 0 and f["step_s"] > 0 and f["mfu"] is None  # no CPU peak given
        for phase, (planned, measured) in f["peaks"].items():
            assert planned == pytest.approx(measured, rel=0.25), (name, phase)
    assert figures["toy-qwen2.5-vl-3b"]["trained"] < figures["toy-qwen2.5-vl-3b"]["params"]  # the tower frozen


def test_prompts_have_exactly_the_asked_length_and_images_their_tokens(tmp_path):
    spec = importlib.util.spec_from_file_location("scale", SCRIPT)
    scale = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(scale)
    values = scale.model_config("qwen2.5-vl-3b", toy=True)
    tokenizer = scale.synthetic_tokenizer(values)
    assert len(tokenizer) == 512 and tokenizer.convert_tokens_to_ids("<|image_pad|>") == values["image_token_id"]
    data = scale.write_data(tmp_path, 512, 3, prompt_len=17, image=False)
    for row in map(json.loads, data.read_text().splitlines()):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": row["question"]}], add_generation_prompt=True)["input_ids"]
        assert len(ids) == 17 and tokenizer.unk_token_id not in ids[1:]
    assert scale.image_tokens(224) == 64 + 2  # 16 x 16 patches merged 2 x 2, with the start and end tokens
