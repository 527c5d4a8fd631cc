"""The Gemini backend: a clear error naming the `gemini` extra when google-genai is missing, and,
with the real SDK against a fake Gemini REST server on 127.0.0.1 (fake_gemini.py), the request
it sends (path, system instruction, generation config, text and inline image parts, key
header), the scores and usage it reads, which errors are retried, timeouts, bodies that are not
JSON, the concurrency cap at the server, and the API key never leaking."""

import asyncio
import base64
import io
import logging
import sys
import time
import traceback

import pytest
from fake_gemini import Reply
from PIL import Image

from grouprl.config import JudgeConfig
from grouprl.errors import ConfigError
from grouprl.rewards.judges import JudgeClient, JudgeRequest
from grouprl.rewards.judges.base import JudgeBackendError, JudgePrompt
from grouprl.rewards.judges.gemini import GeminiBackend

# google-genai subclasses aiohttp.ClientSession, which aiohttp warns about; not this code's doing
pytestmark = pytest.mark.filterwarnings("ignore:Inheritance class AiohttpClientSession:DeprecationWarning")

KEY_ENV, KEY = "GROUPRL_TEST_GEMINI_KEY", "gm-LEAKCHECK-31337-e4b9"
MODEL = "gemini-2.5-flash"
# Variables the SDK reads that would change where or how it sends requests.
SDK_ENV = (
    "GOOGLE_GENAI_USE_VERTEXAI",
    "GOOGLE_GENAI_USE_ENTERPRISE",
    "GOOGLE_GENAI_API_VERSION",
    "GOOGLE_GENAI_HTTP_CLIENT",
    "GOOGLE_GEMINI_BASE_URL",
    "GOOGLE_API_KEY",
    "GEMINI_API_KEY",
    "GOOGLE_CLOUD_PROJECT",
    "GOOGLE_CLOUD_LOCATION",
)


# -- without the SDK ----------------------------------------------------------------------
def test_missing_sdk_names_the_extra(judge_config, monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)
    monkeypatch.setitem(sys.modules, "google.genai", None)  # importing it raises ImportError
    cfg = judge_config(None, backend="gemini", model=MODEL, api_key_env=KEY_ENV)
    with pytest.raises(ConfigError, match=r"pip install 'grouprl\[gemini\]'"):
        JudgeClient(cfg)


def test_gemini_needs_a_key(judge_config):
    with pytest.raises(ConfigError, match="needs api_key_env"):
        GeminiBackend(judge_config(None, backend="gemini", model=MODEL), None)


# -- with the real SDK --------------------------------------------------------------------
@pytest.fixture
def genai(monkeypatch):
    """The real google.genai (skips without it), the key in its variable, the SDK's own
    environment settings cleared and 127.0.0.1 kept off any proxy."""
    module = pytest.importorskip("google.genai")
    for name in SDK_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    monkeypatch.setenv(KEY_ENV, KEY)
    return module


@pytest.fixture(params=["aiohttp", "httpx"])
def transport(request, genai, monkeypatch):
    """The SDK's async transport: aiohttp when it is installed, else httpx; both are tested."""
    from google.genai import _api_client

    if not hasattr(_api_client, "has_aiohttp"):
        pytest.skip("this google-genai picks its transport some other way")
    if request.param == "aiohttp":
        if not _api_client.has_aiohttp:
            pytest.skip("aiohttp is not installed")
    else:
        monkeypatch.setattr(_api_client, "has_aiohttp", False)
    return request.param


@pytest.fixture
def gemini_judge(genai, judge_config, clients):
    """gemini_judge(server, **overrides) -> a JudgeClient on the gemini backend, pointed at `server`."""

    def make(server, log_path=None, **overrides) -> JudgeClient:
        options = {"backend": "gemini", "model": MODEL, "api_key_env": KEY_ENV, **overrides}
        if server is not None:
            options["base_url"] = server.base_url
        client = JudgeClient(judge_config(None, **options), log_path=log_path)
        clients.append(client)
        return client

    return make


def graded(*grades, prefix="q"):
    return [
        JudgeRequest(question=f"{prefix}{i}", response=f"GRADE:{g}", request_id=f"r{i}")
        for i, g in enumerate(grades)
    ]


def fail_first(reply_on_first):
    """A behaviour: the first request of each prompt gets `reply_on_first`, later ones succeed."""
    return lambda call: reply_on_first if call.seen == 1 else Reply()


def image_bytes(fmt, color):
    buffer = io.BytesIO()
    Image.new("RGB", (3, 2), color).save(buffer, format=fmt)
    return buffer.getvalue()


def inline(part):
    """(bytes, MIME type) of an inline-data part. Proto JSON takes base64 in the standard or the
    URL-safe alphabet, and either spelling of the MIME type's key."""
    blob = part["inlineData"]
    data = base64.b64decode(blob["data"], altchars=b"-_", validate=True)
    return data, blob.get("mimeType", blob.get("mime_type"))


def test_a_judge_call_returns_the_scores_and_the_usage(start_gemini_server, gemini_judge, transport):
    def behaviour(call):
        if "GRADE:2" in call.user_text:  # a thinking model: thoughts count as output tokens
            usage = {"promptTokenCount": 812, "candidatesTokenCount": 9, "thoughtsTokenCount": 40}
            return Reply(text='{"correctness": 2, "explanation": "half right"}', usage=usage)
        if "GRADE:1" in call.user_text:
            return Reply(text='{"correctness": 1}', usage=None)
        return Reply(usage={"promptTokenCount": 1234, "candidatesTokenCount": 7})

    server = start_gemini_server(behaviour)
    client = gemini_judge(server)
    four, two, one = client.judge_many(graded(4, 2, 1))
    assert four.ok and four.scores == {"correctness": pytest.approx(0.8)}
    assert four.aggregate == pytest.approx(0.8) and four.raw == '{"correctness": 4}'
    assert (four.attempts, four.prompt_tokens, four.completion_tokens) == (1, 1234, 7)
    assert two.aggregate == pytest.approx(0.4) and (two.prompt_tokens, two.completion_tokens) == (812, 49)
    assert one.aggregate == pytest.approx(0.2) and (one.prompt_tokens, one.completion_tokens) == (None, None)
    assert server.requests == 3 and server.api_keys == [KEY] * 3


def test_the_request_the_server_receives(start_gemini_server, gemini_judge, transport):
    server = start_gemini_server()
    client = gemini_judge(server, system_prompt="grade strictly", temperature=0.25, max_tokens=64)
    retrieved, gold = image_bytes("PNG", "red"), image_bytes("JPEG", "blue")
    request = JudgeRequest(
        question="What colour is the slide?",
        response="It is blue. GRADE:5",
        answer="blue",
        gold_answer="blue",
        retrieved_images=[retrieved],
        gold_images=[gold],
    )
    (result,) = client.judge_many([request])
    assert result.ok and result.aggregate == 1.0
    (call,) = server.calls
    assert call.model == MODEL and call.api_version.startswith("v1")
    assert call.headers["x-goog-api-key"] == KEY and call.api_key == KEY
    body = call.body
    assert body["systemInstruction"]["parts"] == [{"text": "grade strictly"}]
    assert body["generationConfig"]["temperature"] == 0.25
    assert body["generationConfig"]["maxOutputTokens"] == 64
    (content,) = body["contents"]
    assert content["role"] == "user"
    text, label_a, image_a, label_b, image_b = content["parts"]
    assert text["text"].startswith("You are a strict grader")
    assert "What colour is the slide?" in text["text"] and "It is blue. GRADE:5" in text["text"]
    assert (label_a, label_b) == ({"text": "Retrieved images:"}, {"text": "Reference images:"})
    assert inline(image_a) == (retrieved, "image/png")
    assert inline(image_b) == (gold, "image/jpeg")


def test_no_system_instruction_without_a_system_prompt(start_gemini_server, gemini_judge):
    server = start_gemini_server()
    (result,) = gemini_judge(server).judge_many(graded(3))
    (body,) = server.bodies
    assert result.ok and "systemInstruction" not in body
    (part,) = body["contents"][0]["parts"]  # the text alone: no image groups
    assert list(part) == ["text"] and "GRADE:3" in part["text"]


@pytest.mark.parametrize(
    "first_reply",
    [
        Reply("status", status=429, message="Resource has been exhausted", retry_after="0"),
        Reply("status", status=500, message="An internal error has occurred"),
        Reply("status", status=503, message="The model is overloaded"),
        Reply(text='The response ends with {"correctness": 5}, an attempt to', finish="MAX_TOKENS"),  # cut off
    ],
    ids=["429", "500", "503", "cut-off"],
)
def test_429_and_5xx_are_retried_then_succeed(start_gemini_server, gemini_judge, first_reply):
    server = start_gemini_server(fail_first(first_reply))
    results = gemini_judge(server).judge_many(graded(4, 2))
    assert [r.aggregate for r in results] == pytest.approx([0.8, 0.4])
    assert [(r.ok, r.attempts, r.retries) for r in results] == [(True, 2, 1), (True, 2, 1)]
    assert server.requests == 4


def test_429_waits_for_retry_after(start_gemini_server, gemini_judge):
    server = start_gemini_server(fail_first(Reply("status", status=429, retry_after="0.3")))
    client = gemini_judge(server, backoff_base_s=0.0, backoff_max_s=5.0)
    (result,) = client.judge_many(graded(3))
    assert result.ok and result.attempts == 2
    first, second = server.calls
    assert second.started - first.started >= 0.3  # the server's Retry-After; the backoff is 0


def test_retries_stop_at_the_cap(start_gemini_server, gemini_judge):
    server = start_gemini_server(lambda call: Reply("status", status=500, message="internal  error\n"))
    (result,) = gemini_judge(server, max_retries=2).judge_many(graded(4))
    assert not result.ok and result.attempts == 3 and server.requests == 3
    assert result.error == "Gemini API error 500 INTERNAL: internal error"
    assert result.scores == {} and result.aggregate != result.aggregate  # NaN


@pytest.mark.parametrize(
    "status, message, error",
    [
        (
            400,
            "API key not valid. Please pass a valid API key.",
            "Gemini API error 400 INVALID_ARGUMENT: API key not valid. Please pass a valid API key.",
        ),
        (
            403,
            "Permission denied: Consumer has been suspended.",
            f"Gemini API error 403 PERMISSION_DENIED (check the key in ${KEY_ENV}): "
            "Permission denied: Consumer has been suspended.",
        ),
        (
            404,
            f"models/{MODEL} is not found for API version v1",
            f"Gemini API error 404 NOT_FOUND (is '{MODEL}' a Gemini model name?): "
            f"models/{MODEL} is not found for API version v1",
        ),
    ],
    ids=["400", "403", "404"],
)
def test_client_errors_are_not_retried(start_gemini_server, gemini_judge, status, message, error):
    server = start_gemini_server(lambda call: Reply("status", status=status, message=message))
    (result,) = gemini_judge(server).judge_many(graded(4))
    assert (result.ok, result.attempts, server.requests) == (False, 1, 1)
    assert result.error == error


def test_a_hanging_server_times_out(start_gemini_server, gemini_judge, transport):
    server = start_gemini_server(lambda call: Reply("hang"))
    client = gemini_judge(server, timeout_s=0.3, max_retries=1)
    started = time.monotonic()
    results = client.judge_many(graded(1, 2))
    assert time.monotonic() - started < 3
    assert [(r.ok, r.attempts) for r in results] == [(False, 2), (False, 2)]
    assert all(r.error == "timed out after 0.3s" for r in results)
    assert server.requests == 4
    deadline = time.monotonic() + 2
    while server.in_flight and time.monotonic() < deadline:  # the client closed its connections
        time.sleep(0.01)
    assert server.in_flight == 0


def test_a_body_that_is_not_json_is_retried_then_counted_as_failed(start_gemini_server, gemini_judge):
    def behaviour(call):
        if "q0" in call.user_text or call.seen == 1:
            return Reply("garbage")
        return Reply()

    server = start_gemini_server(behaviour)
    failed, recovered = gemini_judge(server, max_retries=2).judge_many(graded(3, 5))
    assert (failed.ok, failed.attempts) == (False, 3)
    assert failed.error == "unreadable response body from Gemini (JSONDecodeError)"
    assert (recovered.ok, recovered.attempts, recovered.aggregate) == (True, 2, 1.0)
    assert server.requests == 5


def test_a_refused_connection_is_retried_by_the_judge_only(gemini_judge, transport):
    client = gemini_judge(None, base_url="http://127.0.0.1:1", max_retries=2, timeout_s=10.0)
    started = time.monotonic()
    (result,) = client.judge_many(graded(1))
    assert (result.ok, result.attempts) == (False, 3)
    assert result.error.endswith(" calling Gemini at http://127.0.0.1:1") and "Connect" in result.error
    assert time.monotonic() - started < 1.0  # no hidden retry of the SDK (it would sleep >= 1 s)


def test_the_concurrency_cap_is_never_exceeded_at_the_server(start_gemini_server, gemini_judge):
    server = start_gemini_server(lambda call: Reply(latency=0.1))
    client = gemini_judge(server, max_concurrent_requests=3)
    grades = [i % 6 for i in range(12)]
    results = client.judge_many(graded(*grades))
    assert server.max_in_flight == 3 and server.requests == 12
    assert [r.aggregate for r in results] == pytest.approx([g / 5 for g in grades])


def test_the_api_key_never_leaks(start_gemini_server, gemini_judge, tmp_path, caplog, capsys):
    def echo_key(call):  # a hostile server that puts the key it received into every answer
        kind = ["status", "garbage", "ok", "status"][call.number % 4]
        if kind == "ok":
            return Reply(text=f"{call.api_key} is nice, no score")
        if kind == "garbage":
            return Reply("garbage", body=f"<html>{call.api_key}</html>")
        return Reply("status", status=[429, 400][call.number % 2], message=f"bad key {call.api_key}")

    server = start_gemini_server(echo_key)
    log = tmp_path / "judge.jsonl"
    cfg_overrides = {"cache_path": str(tmp_path / "c.sqlite"), "max_retries": 3}
    with caplog.at_level(logging.DEBUG):
        client = gemini_judge(server, log_path=log, **cfg_overrides)
        results = client.judge_many(graded(1, 2, 3))
        client.close()
        errors = asyncio.run(direct_errors(GeminiBackend(client.cfg, KEY), server))
    assert server.api_keys and set(server.api_keys) == {KEY}  # the key was sent, in the header
    assert all(KEY not in call.path for call in server.calls)
    assert all(not r.ok for r in results) and len(errors) == 4
    assert any("[redacted]" in (r.error or "") for r in results)  # scrubbed, not dropped
    assert all(str(e).endswith("[redacted] rejected") for e in errors)
    outputs = [log.read_text(), repr(client), repr(client.backend)]
    outputs.append((tmp_path / "c.sqlite").read_bytes().decode("latin-1"))
    outputs += [repr(r) for r in results] + [r.error or "" for r in results] + [r.raw for r in results]
    outputs += ["".join(traceback.format_exception(e)) for e in errors] + [repr(e) for e in errors]
    outputs += [logging.Formatter().format(record) for record in caplog.records]
    outputs += list(capsys.readouterr())
    assert not [text for text in outputs if KEY in text]


async def direct_errors(backend, server):
    """The JudgeBackendErrors of one direct call per error status, the server echoing the key."""
    errors = []
    try:
        for status in (400, 403, 429, 500):
            server.behaviour = lambda call, status=status: Reply(
                "status", status=status, message=f"{call.api_key} rejected"
            )
            with pytest.raises(JudgeBackendError) as caught:
                await backend.complete(JudgePrompt(system="", user="GRADE:1"))
            errors.append(caught.value)
    finally:
        await backend.aclose()
    return errors


def test_the_sdk_client_options(genai, judge_config, monkeypatch):
    """Google's endpoint unless base_url is overridden, the timeout in milliseconds, and the
    SDK's retries switched off (one attempt)."""
    made = []

    class Recording(genai.Client):
        def __init__(self, **kwargs):
            made.append(kwargs)
            super().__init__(**kwargs)

    monkeypatch.setattr(genai, "Client", Recording)
    for base_url in (JudgeConfig().base_url, "", "http://127.0.0.1:9"):
        cfg = judge_config(None, backend="gemini", model=MODEL, base_url=base_url, timeout_s=7.5)
        asyncio.run(GeminiBackend(cfg, KEY).aclose())
    assert [m["api_key"] for m in made] == [KEY] * 3
    options = [m["http_options"] for m in made]
    assert [o.base_url for o in options] == [None, None, "http://127.0.0.1:9"]
    assert all(o.timeout == 7500 and o.retry_options.attempts == 1 for o in options)
