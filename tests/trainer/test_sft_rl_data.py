"""`grouprl sft` on data in the RL layouts: verl conversations (`prompt` ending with the assistant's
turn, HF-datasets image dicts), RL prompts with their ground truth as the reply, the dry run's
per-file lines, and held-out accuracy on an RL file scored as `grouprl eval` scores it."""

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from grouprl.cli import main
from grouprl.config import load_config
from grouprl.errors import ConfigError, DataError
from grouprl.trainer.sft import run_sft, validate_sft
from grouprl.trainer.sft_data import load_conversations, tokenize_all
from vision_helpers import tiny_vlm

RED, BLUE = (220, 20, 20), (20, 20, 220)
TEMPLATE = (  # as test_sft_vision's: the generation prompt is what precedes an assistant's content
    "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def png(colour) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (56, 56), colour).save(buffer, format="PNG")
    return buffer.getvalue()


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def colour_rows(n, folder, *, as_paths=False, conversation=False, start=0):
    """verl rows asking an image's colour: images as HF-datasets dicts with bytes (or a path
    relative to the file), the answer as reward_model.ground_truth (or the prompt's last turn)."""
    rows = []
    for i in range(start, start + n):
        colour = ["red", "blue"][i % 2]
        if as_paths:
            (folder / "img").mkdir(exist_ok=True)
            Image.new("RGB", (56, 56), RED if colour == "red" else BLUE).save(folder / "img" / f"{i}.png")
            image = {"bytes": None, "path": f"img/{i}.png"}
        else:
            image = {"bytes": png(RED if colour == "red" else BLUE), "path": None}
        prompt = [{"role": "user", "content": "<image>colour?"}]
        if conversation:
            prompt.append({"role": "assistant", "content": colour})
        rows.append({
            "data_source": "colours",
            "prompt": prompt,
            "images": [image],
            "reward_model": {"style": "rule", "ground_truth": colour},
            "extra_info": {"index": i},
        })
    return rows


# -- reading -------------------------------------------------------------------------------
def test_a_verl_conversation_is_learned_as_it_is(tmp_path):
    path = write_parquet(tmp_path / "c.parquet", colour_rows(2, tmp_path, conversation=True))
    first, second = load_conversations([path])
    assert first.messages == [
        {"role": "user", "content": "<image>colour?"},
        {"role": "assistant", "content": "red"},
    ]
    assert first.train_on == [1] and first.id == "c-0" and second.id == "c-1"  # the uids RL gives them
    assert first.images == [{"bytes": png(RED), "path": None}]


def test_rl_prompts_learn_their_ground_truth_through_the_template(tmp_path):
    few_shot = [
        {"role": "system", "content": "Answer in tags."},
        {"role": "user", "content": "1+1?"},
        {"role": "assistant", "content": "<answer>2</answer>"},
        {"role": "user", "content": "2+2?"},
    ]
    verl = write_jsonl(tmp_path / "v.jsonl", [
        {"prompt": few_shot, "reward_model": {"ground_truth": 4}, "extra_info": {"id": "n"}},
        {"prompt": "3+3?", "reward_model": {"ground_truth": ["6", "six"]}},  # accepted answers: the first
    ])
    plain = write_jsonl(tmp_path / "p.jsonl", [{"id": "p", "question": "Capital of France?", "answer": "Paris"}])
    numeric, listed, capital = load_conversations([verl, plain], "<answer>{ground_truth}</answer>")
    assert numeric.messages == [*few_shot, {"role": "assistant", "content": "<answer>4</answer>"}]
    assert numeric.train_on == [4] and numeric.id == "n"  # the few-shot turn is context, not learned
    assert listed.messages[-1] == {"role": "assistant", "content": "<answer>6</answer>"}
    assert capital.messages == [
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "<answer>Paris</answer>"},
    ]
    (as_is,) = load_conversations([plain])  # the default template: the ground truth as it is
    assert as_is.messages[-1]["content"] == "Paris"
    # data.system_prompt, as RL puts it in front of the prompts (replacing a system message)
    numeric, _, capital = load_conversations([verl, plain], system_prompt="Be brief.")
    assert numeric.messages[0] == capital.messages[0] == {"role": "system", "content": "Be brief."}
    assert numeric.messages[1:4] == few_shot[1:] and numeric.train_on == [4]


def test_images_from_paths_get_their_placeholders_as_rl_does(tmp_path):
    rows = colour_rows(1, tmp_path, as_paths=True)
    rows[0]["prompt"][0]["content"] = "colour?"  # no placeholder: one per image in front, as RL puts it
    (c,) = load_conversations([write_parquet(tmp_path / "v.parquet", rows)])
    assert c.messages[0]["content"] == "<image>colour?"
    assert c.images == [{"bytes": None, "path": str(tmp_path / "img" / "0.png")}]


@pytest.mark.parametrize(
    "row, message",
    [
        ({"prompt": [{"role": "user", "content": "hi"}]},
         "record 1: the prompt does not end with an assistant turn and has no reward_model.ground_truth"),
        ({"prompt": [{"role": "user", "content": "hi"}], "reward_model": {"ground_truth": {"a": 1}}},
         "record 1: the prompt does not end with an assistant turn and has no reward_model.ground_truth"),
        ({"prompt": [{"role": "user", "content": "<image>hi"}], "reward_model": {"ground_truth": "x"}},
         "row 1: 1 <image> placeholder(s) in the prompt but 0 image(s)"),
        ({"prompt": [{"role": "user", "content": ["parts"]}, {"role": "assistant", "content": "x"}]},
         "record 1: message 0 must be an object with text 'content'"),
    ],
)
def test_bad_rl_rows_are_one_line(tmp_path, row, message):
    path = write_jsonl(tmp_path / "v.jsonl", [{"prompt": "ok?", "reward_model": {"ground_truth": "x"}}, row])
    with pytest.raises(DataError) as e:
        load_conversations([path])
    assert str(e.value).startswith(f"{path} ") and message in str(e.value) and "\n" not in str(e.value)


def test_plain_rows_without_answers_and_other_columns_are_refused(tmp_path):
    with pytest.raises(DataError, match="record 0: the prompt does not end with an assistant turn and has no 'answer'"):
        load_conversations([write_jsonl(tmp_path / "q.jsonl", [{"question": "hi"}])])
    with pytest.raises(DataError, match=r"has columns text; expected conversations \(messages\), or the verl layout"):
        load_conversations([write_jsonl(tmp_path / "t.jsonl", [{"text": "hi"}])])


def test_reply_template_must_name_the_ground_truth():
    with pytest.raises(ConfigError, match="'sft.reply_template' must hold {ground_truth}"):
        validate_sft(load_config(None, ["sft.reply_template=<answer></answer>"]).sft)


def test_a_vlm_reads_the_same_tokens_from_bytes_and_from_paths(tmp_path):
    _, tokenizer, vision = tiny_vlm("qwen2_vl")
    rows = colour_rows(2, tmp_path, conversation=True)
    from_bytes = load_conversations([write_parquet(tmp_path / "b.parquet", rows)])
    (tmp_path / "p").mkdir()
    from_paths = load_conversations(
        [write_parquet(tmp_path / "p" / "p.parquet", colour_rows(2, tmp_path / "p", as_paths=True, conversation=True))]
    )
    a, _ = tokenize_all(tokenizer, from_bytes, 256, "skip", vision)
    b, _ = tokenize_all(tokenizer, from_paths, 256, "skip", vision)
    assert [r.input_ids for r in a] == [r.input_ids for r in b]
    assert [r.loss_mask for r in a] == [r.loss_mask for r in b]
    for x, y in zip(a, b):
        torch.testing.assert_close(x.images[0].tensors["pixel_values"], y.images[0].tensors["pixel_values"])


# -- the dry run ---------------------------------------------------------------------------
def test_dry_run_names_each_files_layout(tmp_path, capsys):
    train = write_parquet(tmp_path / "t.parquet", colour_rows(2, tmp_path))
    val = write_parquet(tmp_path / "v.parquet", colour_rows(2, tmp_path, conversation=True))
    code = main([
        "sft", "--dry-run", f"sft.train_files=[{train}]", f"sft.val_files=[{val}]", f"sft.val_rl_files=[{train}]",
        "sft.reply_template=<answer>{ground_truth}</answer>", "sft.optim.lr=1e-4",
    ])
    out = capsys.readouterr().out
    assert code == 0
    assert (
        f"  data (train): {train}: verl layout: prompt, reward_model.ground_truth as the assistant's reply "
        "(as '<answer>{ground_truth}</answer>'), images\n"
    ) in out
    assert f"  data (held-out): {val}: verl layout: conversations in 'prompt' (its assistant turns are learned), images\n" in out
    assert f"  data (held-out accuracy): {train}: verl layout: prompt, reward_model.ground_truth, images\n" in out
    assert "held-out accuracy: greedy answers of <= 128 tokens scored by reward.val_metric=correctness" in out


def test_dry_run_stops_at_a_missing_column_with_one_line(tmp_path, capsys):
    rows = colour_rows(1, tmp_path)
    del rows[0]["reward_model"]
    train = write_parquet(tmp_path / "t.parquet", rows)
    code = main(["sft", "--dry-run", f"sft.train_files=[{train}]", "sft.optim.lr=1e-4"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""  # never "config is valid"
    assert err == (
        f"grouprl: error: {train}: verl layout without reward_model.ground_truth (no prompt of its first rows "
        "ends with an assistant turn): nothing to learn as the assistant's reply\n"
    )


# -- held-out accuracy -----------------------------------------------------------------------
def test_a_tiny_vlm_learns_colours_from_rl_files_and_reports_accuracy(tmp_path):
    """The user's case: verl files with HF image dicts, SFT on prompt + ground truth, accuracy on
    an RL held-out file; answers.jsonl pairs with `grouprl eval`'s of the saved model, line by line."""
    tiny_vlm("idefics3", tmp_path / "model", vision_init_std=0.2, chat_template=TEMPLATE)
    train = write_parquet(tmp_path / "train.parquet", colour_rows(16, tmp_path))
    val = write_parquet(tmp_path / "val.parquet", colour_rows(4, tmp_path, as_paths=True, start=100))
    common = [
        f"model.path={tmp_path / 'model'}", "reward.components=[{name: correctness}]", "reward.val_metric=correctness",
        "rollout.max_response_length=24", "rollout.stop=['</answer>']", "trainer.device=cpu",
    ]
    cfg = load_config(None, [
        *common, "model.freeze_vision_tower=false", f"sft.train_files=[{train}]", f"sft.val_rl_files=[{val}]",
        "sft.reply_template=<answer>{ground_truth}</answer>", "sft.max_steps=30", "sft.batch_size=8",
        "sft.micro_batch_size=4", "sft.optim.lr=1e-2", "sft.preview_samples=0", f"sft.output_dir={tmp_path / 'run'}",
        "sft.loggers=[jsonl]",
    ])
    summary = run_sft(cfg)
    assert summary["accuracy_before"] == 0.0 and summary["accuracy_after"] == 1.0, summary
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["eval/accuracy"] for m in metrics if "eval/accuracy" in m] == [0.0, 1.0]
    answers = [json.loads(x) for x in (tmp_path / "run" / "answers.jsonl").read_text().splitlines()]
    assert [(a["step"], a["uid"]) for a in answers] == [(s, f"val-{i}") for s in (0, 30) for i in range(100, 104)]
    after = answers[4:]
    assert [a["response"] for a in after] == ["<answer>red</answer>", "<answer>blue</answer>"] * 2

    # grouprl eval of the saved model: the same answers, in the same order, with the same scores
    assert main(["eval", *common, f"model.path={tmp_path / 'run' / 'model'}", f"data.train_files=[{val}]",
                 f"data.val_files=[{val}]", f"trainer.eval_dir={tmp_path / 'eval'}"]) == 0
    evaluated = [json.loads(x) for x in (tmp_path / "eval" / "answers.jsonl").read_text().splitlines()]
    assert [{k: a[k] for k in e} for a, e in zip(after, evaluated)] == evaluated
