"""Observation messages rendered token-exactly through real chat templates.

The tokenizers here are character-level with each template's special tokens added, so every
expected span can be written out by hand. Templates: ChatML (SmolLM2 / Qwen), Llama-3, ChatML
that injects a default system prompt when none is given (Qwen2.5), and one that drops <think>
blocks from earlier assistant turns (not append-only).
"""

import pytest

from grouprl.errors import ConfigError
from grouprl.rollout.chat import ChatRenderer
from helpers import char_tokenizer

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
CHATML_DEFAULT_SYSTEM = (
    "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\n"
    + DEFAULT_SYSTEM
    + "<|im_end|>\\n' }}{% endif %}"
    + CHATML
)
LLAMA3 = (
    "{{ '<|begin_of_text|>' }}{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + (m['content'] | trim) + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
# assistant turns before the last user message lose their reasoning (as Qwen3's template does)
CHATML_DROP_THINK = (
    "{% set ns = namespace(last_user=-1) %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}{% set c = m['content'] %}"
    "{% if m['role'] == 'assistant' and loop.index0 < ns.last_user and '</think>' in c %}"
    "{% set c = c.split('</think>')[-1] | trim %}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + c + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

TEMPLATES = {
    "chatml": (CHATML, ["<|im_start|>", "<|im_end|>"], "<|im_end|>"),
    "chatml_default_system": (CHATML_DEFAULT_SYSTEM, ["<|im_start|>", "<|im_end|>"], "<|im_end|>"),
    "llama3": (
        LLAMA3,
        ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "<|eot_id|>",
    ),
    "chatml_drop_think": (CHATML_DROP_THINK, ["<|im_start|>", "<|im_end|>"], "<|im_end|>"),
}

# what follows an assistant turn's content for the observation "OBS", written out by hand
EXPECTED_DELTA = {
    "chatml": "<|im_end|>\n<|im_start|>user\nOBS<|im_end|>\n<|im_start|>assistant\n",
    "chatml_default_system": "<|im_end|>\n<|im_start|>user\nOBS<|im_end|>\n<|im_start|>assistant\n",
    "llama3": "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nOBS<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "chatml_drop_think": "<|im_end|>\n<|im_start|>user\nOBS<|im_end|>\n<|im_start|>assistant\n",
}


def chat_tokenizer(name: str):
    """Character tokenizer with the template's special tokens; EOS = its end-of-turn token."""
    template, specials, eos = TEMPLATES[name]
    tokenizer = char_tokenizer(template)
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    tokenizer.eos_token = eos
    return tokenizer


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_observation_delta_is_the_template_text_after_an_assistant_turn(name):
    tokenizer = chat_tokenizer(name)
    renderer = ChatRenderer(tokenizer)
    ids = renderer.observation_ids("OBS")
    assert tokenizer.decode(ids) == EXPECTED_DELTA[name]
    assert renderer.observation_text("OBS") == EXPECTED_DELTA[name]
    # special tokens are single ids, not spelled out character by character
    assert ids[0] == tokenizer.convert_tokens_to_ids(TEMPLATES[name][2])
    assert len(ids) == len(tokenizer(EXPECTED_DELTA[name], add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_an_eos_the_policy_already_wrote_is_not_written_again(name):
    tokenizer = chat_tokenizer(name)
    renderer = ChatRenderer(tokenizer)
    full = renderer.observation_ids("OBS")
    after_eos = renderer.observation_ids("OBS", closing_token=tokenizer.eos_token_id)
    assert after_eos == full[1:]
    # a different last token (the turn ended at a stop string) keeps the end-of-turn token
    assert renderer.observation_ids("OBS", closing_token=tokenizer.convert_tokens_to_ids("x")) == full


def test_default_system_prompt_injection_does_not_leak_into_the_delta():
    tokenizer = chat_tokenizer("chatml_default_system")
    # the naive delta (render with the observation minus render without it) is right here only
    # because the injected system prompt sits in both renders; ours never contains it
    delta = tokenizer.decode(ChatRenderer(tokenizer).observation_ids("OBS"))
    assert DEFAULT_SYSTEM not in delta
    assert delta == EXPECTED_DELTA["chatml"]


def test_template_that_rewrites_earlier_assistant_turns():
    """Rendering the conversation again drops the policy's <think> block, so the text with the
    observation does not start with the text without it; the delta must not depend on that."""
    tokenizer = chat_tokenizer("chatml_drop_think")
    turn = "<think>plan</think><search>q</search>"
    before = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": turn}]
    after = before + [{"role": "user", "content": "OBS"}]
    without = tokenizer.apply_chat_template(before, tokenize=False)
    with_obs = tokenizer.apply_chat_template(after, tokenize=False, add_generation_prompt=True)
    assert not with_obs.startswith(without)  # the template really rewrites the earlier turn
    assert "<think>" in without and "<think>" not in with_obs
    delta = tokenizer.decode(ChatRenderer(tokenizer).observation_ids("OBS"))
    assert delta == EXPECTED_DELTA["chatml_drop_think"]
    assert with_obs.endswith(delta)  # what follows the (rewritten) assistant content is the same


def test_observation_text_with_template_syntax_and_newlines_survives():
    tokenizer = chat_tokenizer("chatml")
    text = "line 1\n{{ not jinja }} <search>x</search>\n"
    ids = ChatRenderer(tokenizer).observation_ids(text)
    assert tokenizer.decode(ids) == f"<|im_end|>\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def test_tool_role():
    tokenizer = chat_tokenizer("chatml")
    delta = tokenizer.decode(ChatRenderer(tokenizer, role="tool").observation_ids("OBS"))
    assert delta == "<|im_end|>\n<|im_start|>tool\nOBS<|im_end|>\n<|im_start|>assistant\n"


def test_template_that_drops_the_role_is_a_config_error():
    only_user_assistant = (
        "{% for m in messages %}{% if m['role'] in ['user', 'assistant'] %}"
        "{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    tokenizer = char_tokenizer(only_user_assistant)
    with pytest.raises(ConfigError, match="observation_role"):
        ChatRenderer(tokenizer, role="tool")
    raising = "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}{% endfor %}"
    with pytest.raises(ConfigError, match="role 'tool'"):
        ChatRenderer(char_tokenizer(raising), role="tool")


def test_base_tokenizer_without_template_uses_role_lines():
    tokenizer = char_tokenizer(None)
    ids = ChatRenderer(tokenizer).observation_ids("OBS")
    assert tokenizer.decode(ids) == "\nuser: OBS\nassistant:"


@pytest.mark.slow
def test_real_smollm2_tokenizer_default_system_template():
    """SmolLM2's template injects a default system prompt; its tokenizer is byte-level BPE."""
    from grouprl.config import ModelConfig
    from grouprl.errors import ModelLoadError
    from grouprl.trainer.models import load_tokenizer, resolve_model_path

    try:
        cfg = ModelConfig()
        tokenizer = load_tokenizer(cfg, resolve_model_path(cfg))
    except ModelLoadError as e:
        pytest.skip(f"built-in SmolLM2 not available: {e}")
    renderer = ChatRenderer(tokenizer)
    text = "Doc 3: the tower is 324 m tall."
    ids = renderer.observation_ids(text)
    assert tokenizer.decode(ids) == f"<|im_end|>\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    # the delta is exactly the tail of the whole conversation's tokenization
    messages = [
        {"role": "user", "content": "How tall?"},
        {"role": "assistant", "content": "<search>tower height</search>"},
        {"role": "user", "content": text},
    ]
    whole = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    whole_ids = tokenizer(whole, add_special_tokens=False)["input_ids"]
    assert whole_ids[-len(ids) :] == ids
    assert "You are a helpful AI assistant named SmolLM" in whole  # the injected default
