"""Supervised fine-tuning of VLMs: conversations with images (paths relative to the file, or
bytes), their image tokens expanded where the placeholders are, the loss against transformers'
own forward, a tiny VLM that learns colours, and the saved folder a working VLM."""

import json

import pytest
import torch
from PIL import Image

from grouprl.config import load_config
from grouprl.errors import DataError
from grouprl.trainer.sft import nll_sum, run_sft
from grouprl.trainer.sft_data import load_conversations, tokenize_all, tokenize_conversation
from vision_helpers import colours, tiny_vlm

RED, BLUE = (220, 20, 20), (20, 20, 220)
# the generation prompt is exactly what precedes an assistant's content (no space after the colon),
# so a greedy answer can start with the trained content
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def write_conversations(folder, n, prefix="c"):
    (folder / "img").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        colour = ["red", "blue"][i % 2]
        Image.new("RGB", (56, 56), RED if colour == "red" else BLUE).save(folder / "img" / f"{prefix}{i}.png")
        rows.append({
            "id": f"{prefix}{i}",
            "messages": [
                {"role": "user", "content": "<image>colour?"},
                {"role": "assistant", "content": colour},
            ],
            "images": [f"img/{prefix}{i}.png"],
        })
    path = folder / f"{prefix}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("family", ["qwen2_vl", "idefics3"])
def test_images_become_their_tokens_and_the_loss_is_the_models(tmp_path, family):
    model, tokenizer, vision = tiny_vlm(family, dtype=torch.float64)
    conversations = load_conversations([str(write_conversations(tmp_path, 4))])
    assert conversations[0].images == [str(tmp_path / "img" / "c0.png")]
    rows, _ = tokenize_all(tokenizer, conversations, 256, "skip", vision)
    row = rows[0]
    assert len(row.images) == 1 and sum(t == vision.family.image_token_id for t in row.input_ids) == row.images[0].num_tokens
    trained = tokenizer.decode([t for t, m in zip(row.input_ids, row.loss_mask) if m])
    assert trained == "red"  # the char template trains the content only
    with torch.no_grad():
        got, n = nll_sum(model, rows, tokenizer.pad_token_id, vision=vision.family)
        want = 0.0
        for r in rows:
            ids = torch.tensor([r.input_ids])
            if family == "qwen2_vl":
                kw = dict(pixel_values=r.images[0].tensors["pixel_values"], image_grid_thw=r.images[0].tensors["image_grid_thw"],
                          mm_token_type_ids=(ids == vision.family.image_token_id).int())
            else:
                kw = dict(pixel_values=r.images[0].tensors["pixel_values"][None],
                          pixel_attention_mask=r.images[0].tensors["pixel_attention_mask"][None])
            logits = model(input_ids=ids, **kw).logits[0].double()
            mask = torch.tensor(r.loss_mask[1:]).bool()
            lp = torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
            want -= float(lp[mask].sum())
    assert n == sum(r.num_targets for r in rows)
    assert float(got) == pytest.approx(want, rel=1e-10)


def test_a_tiny_vlm_learns_colours_and_the_folder_is_a_vlm(tmp_path):
    from transformers import AutoModelForImageTextToText

    tiny_vlm("idefics3", tmp_path / "model", vision_init_std=0.2, chat_template=TEMPLATE)
    train = write_conversations(tmp_path, 16)
    val = write_conversations(tmp_path, 4, prefix="v")
    cfg = load_config(None, [
        f"model.path={tmp_path / 'model'}", "model.freeze_vision_tower=false", f"sft.train_files=[{train}]",
        f"sft.val_files=[{val}]", "sft.max_steps=30", "sft.batch_size=8", "sft.micro_batch_size=4",
        "sft.optim.lr=1e-2", "sft.preview_samples=4", "sft.preview_max_tokens=4", f"sft.output_dir={tmp_path / 'run'}",
        "sft.loggers=[jsonl]", "trainer.device=cpu",
    ])
    summary = run_sft(cfg)
    assert summary["eval_loss_after"] < 0.2 * summary["eval_loss_before"], summary
    # greedy answers with the image shown: red, blue, red, blue (the character template has no
    # end-of-turn token, so nothing taught the model to stop after the word)
    after = [json.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()][4:]
    assert [r["expected"] for r in after] == ["red", "blue", "red", "blue"]
    assert all(r["generated"].startswith(r["expected"]) for r in after), after
    model = AutoModelForImageTextToText.from_pretrained(summary["model"])
    assert (tmp_path / "run" / "model" / "preprocessor_config.json").is_file()
    assert type(model).__name__ == "Idefics3ForConditionalGeneration"


@pytest.mark.parametrize(
    "record, message",
    [
        ({"messages": [{"role": "user", "content": "<image><image>?"}, {"role": "assistant", "content": "x"}],
          "images": ["a.png"]}, "record 0: 2 <image> placeholder(s) but 1 image(s)"),
        ({"messages": [{"role": "user", "content": "<image>?"}, {"role": "assistant", "content": "x"}],
          "images": ["gone.png"]}, "record 0: image 0: image file not found: {dir}/gone.png"),
        ({"messages": [{"role": "user", "content": "?"}, {"role": "assistant", "content": "<image>"}],
          "images": ["a.png"]}, "record 0: a trained assistant message holds an <image> placeholder"),
    ],
)
def test_bad_image_conversations_are_one_line(tmp_path, record, message):
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(DataError) as e:
        load_conversations([str(path)])
    assert str(e.value) == f"{path} " + message.format(dir=tmp_path)


def test_images_for_a_text_model_are_refused():
    from grouprl.trainer.sft_data import Conversation
    from helpers import char_tokenizer

    conversation = Conversation("c", [{"role": "user", "content": "<image>?"}, {"role": "assistant", "content": "x"}],
                                [1], [colours(1)[0]])
    with pytest.raises(DataError, match="conversation c has images but the model reads none"):
        tokenize_conversation(char_tokenizer(), conversation)
