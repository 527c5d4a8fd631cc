"""The Gemini backend: a clear error naming the `gemini` extra when google-genai is missing, and
(with a stand-in `google.genai` module that records what it is given) the request it builds,
the usage it reads, and which API errors are retried."""

import sys
import types

import pytest

from grouprl.config import JudgeConfig
from grouprl.errors import ConfigError
from grouprl.rewards.judges import JudgeClient, JudgeRequest
from grouprl.rewards.judges.gemini import GeminiBackend

KEY = "gm-LEAKCHECK-31337"


def test_missing_sdk_names_the_extra(judge_config, monkeypatch):
    monkeypatch.setenv("GROUPRL_TEST_GEMINI_KEY", KEY)
    monkeypatch.setitem(sys.modules, "google.genai", None)  # importing it raises ImportError
    cfg = judge_config(
        None, backend="gemini", model="gemini-2.5-flash", api_key_env="GROUPRL_TEST_GEMINI_KEY"
    )
    with pytest.raises(ConfigError, match=r"pip install 'grouprl\[gemini\]'"):
        JudgeClient(cfg)


def test_gemini_needs_a_key(judge_config):
    with pytest.raises(ConfigError, match="needs api_key_env"):
        GeminiBackend(judge_config(None, backend="gemini", model="gemini-2.5-flash"), None)


class APIError(Exception):
    def __init__(self, code, message):
        super().__init__(message)
        self.code, self.message = code, message


def fake_genai(script):
    """A stand-in for google.genai: Client(...).aio.models.generate_content follows `script`."""
    seen = {"clients": [], "calls": []}

    class Part:
        def __init__(self, **fields):
            self.fields = fields

        @classmethod
        def from_text(cls, text):
            return cls(text=text)

        @classmethod
        def from_bytes(cls, data, mime_type):
            return cls(data=data, mime_type=mime_type)

    class Models:
        async def generate_content(self, model, contents, config):
            seen["calls"].append({"model": model, "contents": contents, "config": config})
            outcome = script[len(seen["calls"]) - 1]
            if isinstance(outcome, Exception):
                raise outcome
            usage = types.SimpleNamespace(prompt_token_count=30, candidates_token_count=4)
            return types.SimpleNamespace(text=outcome, usage_metadata=usage)

    class Client:
        def __init__(self, api_key, http_options):
            seen["clients"].append({"api_key": api_key, "http_options": http_options})
            self.aio = types.SimpleNamespace(models=Models())

    genai = types.ModuleType("google.genai")
    genai.Client = Client
    genai.types = types.SimpleNamespace(
        Part=Part,
        HttpOptions=lambda **kw: kw,
        GenerateContentConfig=lambda **kw: kw,
    )
    genai.errors = types.SimpleNamespace(APIError=APIError)
    google = types.ModuleType("google")
    google.genai = genai
    return google, genai, seen


def test_requests_usage_and_retries_through_the_sdk(judge_config, clients, monkeypatch):
    script = [
        APIError(429, f"quota exceeded for key {KEY}"),
        '{"correctness": 4}',
        APIError(400, f"bad request for {KEY}"),
    ]
    google, genai, seen = fake_genai(script)
    monkeypatch.setitem(sys.modules, "google", google)
    monkeypatch.setitem(sys.modules, "google.genai", genai)
    monkeypatch.setitem(sys.modules, "google.genai.types", genai.types)
    monkeypatch.setitem(sys.modules, "google.genai.errors", genai.errors)
    monkeypatch.setenv("GROUPRL_TEST_GEMINI_KEY", KEY)
    cfg = judge_config(
        None,
        backend="gemini",
        model="gemini-2.5-flash",
        api_key_env="GROUPRL_TEST_GEMINI_KEY",
        system_prompt="grade strictly",
        temperature=0.0,
        max_tokens=64,
        timeout_s=7.0,
        base_url=JudgeConfig().base_url,  # the default: Google's endpoint, no override
    )
    client = JudgeClient(cfg)
    clients.append(client)
    (scored,) = client.judge_many([JudgeRequest(question="q", response="r", gold_images=[_png()])])
    assert scored.ok and scored.aggregate == pytest.approx(0.8)
    assert (scored.attempts, scored.prompt_tokens, scored.completion_tokens) == (2, 30, 4)
    assert seen["clients"] == [{"api_key": KEY, "http_options": {"timeout": 7000}}]
    call = seen["calls"][1]
    assert call["model"] == "gemini-2.5-flash"
    assert call["config"] == {
        "temperature": 0.0,
        "max_output_tokens": 64,
        "system_instruction": "grade strictly",
    }
    parts = [p.fields for p in call["contents"]]
    assert parts[0]["text"].startswith("You are a strict grader") and parts[1] == {
        "text": "Reference images:"
    }
    assert parts[2] == {"data": _png(), "mime_type": "image/png"}

    (rejected,) = client.judge_many([JudgeRequest(question="other", response="r")])
    assert rejected.attempts == 1 and rejected.error == "Gemini API error 400: bad request for [redacted]"


def _png():
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (2, 2)).save(buffer, format="PNG")
    return buffer.getvalue()
