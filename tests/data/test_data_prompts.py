import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from grouprl.data import encode_prompt, fit_prompt
from grouprl.errors import ConfigError

WORDS = ["[UNK]", "<|im_start|>", "<|im_end|>", "system", "user", "assistant", "be", "brief", "hi", ":"]
ID = {word: i for i, word in enumerate(WORDS)}
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


def tiny_tokenizer(chat_template=CHATML):
    """A word-level tokenizer with ChatML specials, built here (no hub access)."""
    backend = Tokenizer(models.WordLevel({w: i for w, i in ID.items()}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = chat_template
    return tokenizer


def test_chat_template_ids_with_generation_prompt():
    ids = encode_prompt(tiny_tokenizer(), MESSAGES)
    start, end = ID["<|im_start|>"], ID["<|im_end|>"]
    assert ids == [
        start,
        ID["system"],
        ID["be"],
        ID["brief"],
        end,
        start,
        ID["user"],
        ID["hi"],
        end,
        start,
        ID["assistant"],
    ]
    assert all(type(i) is int for i in ids)


def test_without_chat_template_falls_back_to_role_lines():
    ids = encode_prompt(tiny_tokenizer(chat_template=None), MESSAGES)
    # "system: be brief\nuser: hi\nassistant:"
    assert ids == [
        ID["system"],
        ID[":"],
        ID["be"],
        ID["brief"],
        ID["user"],
        ID[":"],
        ID["hi"],
        ID["assistant"],
        ID[":"],
    ]


class ReturnsAs:
    """A tokenizer stub whose apply_chat_template returns `value` (the kinds seen in the wild)."""

    chat_template = "stub"

    def __init__(self, value):
        self.value = value

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert add_generation_prompt and tokenize
        return self.value


@pytest.mark.parametrize(
    "returned",
    [
        [5, 6, 7],
        {"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1]},
        {"input_ids": [[5, 6, 7]]},
        torch.tensor([[5, 6, 7]]),
        [[5, 6, 7]],
    ],
)
def test_every_return_kind_becomes_a_flat_list(returned):
    assert encode_prompt(ReturnsAs(returned), MESSAGES) == [5, 6, 7]


def test_a_real_batch_is_an_internal_error():
    with pytest.raises(ValueError, match="batch of 2"):
        encode_prompt(ReturnsAs([[1], [2]]), MESSAGES)


def test_fit_prompt():
    ids = [1, 2, 3, 4, 5]
    assert fit_prompt(ids, 5, "skip") == ids
    assert fit_prompt(ids, 4, "skip") is None
    assert fit_prompt(ids, 3, "truncate") == [3, 4, 5]
    assert fit_prompt(ids, 9, "truncate") == ids
    with pytest.raises(ConfigError, match="skip, truncate"):
        fit_prompt(ids, 3, "drop")
    with pytest.raises(ConfigError, match=">= 1"):
        fit_prompt(ids, 0, "skip")
