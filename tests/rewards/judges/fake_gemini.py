"""A fake Gemini REST server on 127.0.0.1, for the gemini backend's tests.

    with FakeGeminiServer() as server:                 # a random free port, its own threads
        cfg = JudgeConfig(backend="gemini", base_url=server.base_url, model="gemini-2.5-flash", ...)
        ... server.calls, server.api_keys, server.max_in_flight ...

It answers `POST /{api_version}/models/{model}:generateContent`, the request google-genai sends
for `generate_content`, with a GenerateContentResponse (`candidates[0].content.parts[].text` and
`usageMetadata`), and any other path with a Gemini error body (404 NOT_FOUND). The stdlib
`ThreadingHTTPServer` serves it (HTTP/1.1 keep-alive, one thread per connection).

Each request is answered by `behaviour(call)` -> `Reply`, where `call` holds the request number
and target, the API version and model from the path, the parsed body, its user text (the `text` parts), how
often the same user text was seen, and the API key the request carried (`x-goog-api-key`
header, else the `key` query parameter).
Reply kinds: "ok" (the candidate text `text`), "status" (an HTTP status with a Gemini error body
`{"error": {"code", "message", "status"}}`, optional Retry-After), "hang" (no answer until the
client closes the connection or the server stops), "garbage" (200 with a body that is not JSON).

Without a behaviour the judge answers `{"correctness": N}`, N being the digit after the last
"GRADE:" in the user text (0 if none).
"""

from __future__ import annotations

import json
import re
import select
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from rewards.judges.fake_server import default_judge_text

_PATH = re.compile(r"^/(?P<version>[^/]+)/models/(?P<model>[^/:]+):generateContent$")
# google.rpc.Code names Gemini puts in error.status
STATUS_NAMES = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    429: "RESOURCE_EXHAUSTED",
    500: "INTERNAL",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}


@dataclass
class Call:
    number: int  # 1-based, over the server's life
    path: str  # the request target, query included
    api_version: str  # e.g. "v1beta"
    model: str  # as in the path, e.g. "gemini-2.5-flash"
    body: dict[str, Any]
    user_text: str  # the text parts of `contents`, joined by newlines
    seen: int  # how many requests (this one included) carried the same user text
    api_key: str  # "" when the request carried none
    headers: dict[str, str]  # lower-cased names
    started: float  # time.monotonic() when the request arrived


@dataclass
class Reply:
    kind: str = "ok"  # ok | status | hang | garbage
    text: str | None = None  # kind ok: the candidate's text (None: the default judge)
    status: int = 200  # kind status
    message: str = "error"  # kind status: error.message
    retry_after: str | None = None  # kind status: the Retry-After header value
    body: str = ""  # kind garbage: the body ("" = an HTML page)
    usage: dict[str, int] | None = field(
        default_factory=lambda: {"promptTokenCount": 11, "candidatesTokenCount": 7}
    )  # kind ok: usageMetadata (None: left out)
    latency: float = 0.0  # seconds before answering
    finish: str = "STOP"  # kind ok: the candidate's finishReason ("MAX_TOKENS": cut off)


def user_text_of(body: dict[str, Any]) -> str:
    texts = []
    for content in body.get("contents", []):
        if isinstance(content, dict):
            texts.extend(p["text"] for p in content.get("parts", []) if isinstance(p, dict) and "text" in p)
    return "\n".join(texts)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the SDK's connection pools expect
    timeout = 10  # an idle keep-alive connection is closed after this many seconds
    server: _HTTPServer

    def do_POST(self) -> None:  # noqa: N802 - the http.server interface
        self.server.fake._answer(self)

    def log_message(self, *args: object) -> None:
        pass


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    fake: FakeGeminiServer


class FakeGeminiServer:
    def __init__(self, behaviour: Callable[[Call], Reply] | None = None) -> None:
        self.behaviour = behaviour
        self.calls: list[Call] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.seen: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    @property
    def base_url(self) -> str:
        """What `HttpOptions(base_url=...)` takes: the SDK adds `/{api_version}/models/...`."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def bodies(self) -> list[dict[str, Any]]:
        return [c.body for c in self.calls]

    @property
    def api_keys(self) -> list[str]:
        return [c.api_key for c in self.calls]

    @property
    def requests(self) -> int:
        return len(self.calls)

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> FakeGeminiServer:
        self._httpd = _HTTPServer(("127.0.0.1", 0), _Handler)
        self._httpd.fake = self
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="fake-gemini", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is None or self._thread is None:
            return
        self._stopping.set()  # ends hanging requests
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=10)
        self._httpd = None

    def __enter__(self) -> FakeGeminiServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- serving ---------------------------------------------------------------------------
    def _answer(self, handler: _Handler) -> None:
        started = time.monotonic()
        raw = handler.rfile.read(int(handler.headers.get("Content-Length") or 0))
        url = urlsplit(handler.path)
        match = _PATH.match(url.path)
        if match is None:
            self._send_error(handler, 404, f"no route for {url.path}", None)
            return
        try:
            body = json.loads(raw)
        except ValueError:
            body = {}
        headers = {k.lower(): v for k, v in handler.headers.items()}
        api_key = headers.get("x-goog-api-key") or parse_qs(url.query).get("key", [""])[0]
        text = user_text_of(body)
        with self._lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            self.seen[text] += 1
            call = Call(
                number=len(self.calls) + 1,
                path=handler.path,
                api_version=match["version"],
                model=match["model"],
                body=body,
                user_text=text,
                seen=self.seen[text],
                api_key=api_key,
                headers=headers,
                started=started,
            )
            self.calls.append(call)
        try:
            reply = self.behaviour(call) if self.behaviour else Reply()
            if reply.kind == "hang":
                self._hang(handler)
                return
            if reply.latency and self._stopping.wait(reply.latency):
                handler.close_connection = True
                return
            self._send(handler, reply, call)
        finally:
            with self._lock:
                self.in_flight -= 1

    def _hang(self, handler: _Handler) -> None:
        """Wait, answering nothing, until the client closes the connection or the server stops."""
        handler.close_connection = True
        connection: socket.socket = handler.connection
        while not self._stopping.is_set():
            readable, _, _ = select.select([connection], [], [], 0.05)
            if readable:  # end of stream (the client gave up) or bytes the server will not read
                return

    def _send(self, handler: _Handler, reply: Reply, call: Call) -> None:
        if reply.kind == "ok":
            text = default_judge_text(call.user_text) if reply.text is None else reply.text
            payload: dict[str, Any] = {
                "candidates": [
                    {
                        "content": {"role": "model", "parts": [{"text": text}]},
                        "finishReason": reply.finish,
                        "index": 0,
                    }
                ],
                "modelVersion": call.model,
                "responseId": f"fake-{call.number}",
            }
            if reply.usage is not None:
                payload["usageMetadata"] = {**reply.usage, "totalTokenCount": sum(reply.usage.values())}
            self._write(handler, 200, json.dumps(payload).encode(), "application/json")
        elif reply.kind == "status":
            self._send_error(handler, reply.status, reply.message, reply.retry_after)
        elif reply.kind == "garbage":
            data = (reply.body or "<html><body>502 upstream garbage</body></html>").encode()
            self._write(handler, 200, data, "text/html")
        else:
            raise ValueError(f"unknown reply kind {reply.kind!r}")

    def _send_error(self, handler: _Handler, status: int, message: str, retry_after: str | None) -> None:
        error = {"code": status, "message": message, "status": STATUS_NAMES.get(status, "UNKNOWN")}
        extra = {"Retry-After": retry_after} if retry_after is not None else {}
        self._write(handler, status, json.dumps({"error": error}).encode(), "application/json", extra)

    @staticmethod
    def _write(
        handler: _Handler, status: int, data: bytes, content_type: str, extra: dict[str, str] | None = None
    ) -> None:
        handler.send_response(status)
        handler.send_header("Content-Type", f"{content_type}; charset=UTF-8")
        handler.send_header("Content-Length", str(len(data)))
        for name, value in (extra or {}).items():
            handler.send_header(name, value)
        handler.end_headers()
        handler.wfile.write(data)
