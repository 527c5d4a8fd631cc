"""The viewer's HTTP side: the page, its scripts, a JSON API over the runs and their image files.

Every route is a GET; nothing a request says is written anywhere. Files are served only from
inside a run folder and only as images (`Run.file`); the page's scripts are the package's own
(`static/`) and plotly's, from the installed plotly package: nothing comes from the network.

A run's text is untrusted (the policy wrote it, a dataset came from the internet), so:
- every route answers only a Host that is this machine's loopback, the `--host` given, or an
  address written out (`ports.TrustedHosts`): a page elsewhere that rebinds its name to
  127.0.0.1 is refused;
- every answer carries a Content-Security-Policy (`CSP`): scripts, styles, connections and
  images from this server only (images also as data: URLs), no plugins, no frames, no forms;
- the API's JSON is strict (a NaN is never sent: lines read it as null) and a lone surrogate a
  line's escape made is answered as an escape (JSON in ASCII), not as an error.

    GET /                                   the page
    GET /static/{app.js|style.css|plotly.min.js}
    GET /api/runs                           each run's steps, counts and held-out folders (then
                                            the judge logs' index is built in the background)
    GET /api/runs/{run}/metrics?since=N&generation=G   metrics.jsonl rows (the new ones)
    GET /api/runs/{run}/steps/{step}        a step's groups and their samples' figures
    GET /api/runs/{run}/sample?step=&uid=&sample=      a trajectory: turns, pages, judge calls
    GET /api/runs/{run}/uid?uid=            a prompt's groups across the steps it was drawn at
    GET /api/runs/{run}/answers?folder=     a held-out answers.jsonl
    GET /files/{run}/{path}                 an image inside the run folder
"""

# No `from __future__ import annotations` here: FastAPI reads the endpoint annotations at
# definition time.
import json
from importlib import resources
from pathlib import Path
from typing import Any

from grouprl.ports import TrustedHosts
from grouprl.view.runs import IMAGE_TYPES, Run

STATIC = {"app.js": "text/javascript", "style.css": "text/css"}
# plotly adds one empty <style> element (allowed by its hash, that of "") and fills it through
# the CSSOM, which a policy does not govern; its styles otherwise go through the CSSOM too. The
# one sheet it writes as text, for map traces (maplibre), is refused: the page draws no map
# (tests/view/test_view_browser.py: that is the only violation chromium reports).
EMPTY_STYLE = "'sha256-47DEQpj8HBSa+/TImW+5JCeuQeRkm5NMpJWZG3hSuFU='"
CSP = (
    f"default-src 'self'; img-src 'self' data:; style-src 'self' 'report-sample' {EMPTY_STYLE}; "
    "object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'none'"
)
HEADERS = [
    (b"content-security-policy", CSP.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
]


class Guarded:
    """ASGI middleware adding HEADERS to every answer."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def with_headers(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *HEADERS]}
            await send(message)

        await self.app(scope, receive, with_headers)


def as_json(content: Any, status: int = 200) -> Any:
    """`content` as strict JSON (see the module's docstring): pydantic's serializer, or where it
    cannot write a string (a lone surrogate), json's in ASCII."""
    import pydantic_core
    from fastapi.responses import Response

    try:
        body = pydantic_core.to_json(content, inf_nan_mode="null")
    except pydantic_core.PydanticSerializationError:
        body = json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()
    return Response(body, status_code=status, media_type="application/json")


def plotly_js() -> Path | None:
    """plotly.min.js as the plotly package ships it (None without plotly)."""
    import importlib.util

    spec = importlib.util.find_spec("plotly")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "package_data" / "plotly.min.js"
    return path if path.is_file() else None


def create_app(runs: list[Run], hosts: tuple[str, ...] = ()) -> Any:
    """The viewer's ASGI app over `runs`; `hosts`: the names it answers besides the loopback's
    and addresses (the `--host` it listens on)."""
    from fastapi import BackgroundTasks, FastAPI, HTTPException
    from fastapi.responses import FileResponse, HTMLResponse, Response

    app = FastAPI(title="grouprl view", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(TrustedHosts, hosts=hosts, what="grouprl view")
    app.add_middleware(Guarded)  # the outer one: the host check's refusals carry the headers too
    by_name = {run.name: run for run in runs}
    static = resources.files("grouprl.view") / "static"

    def run_named(name: str) -> Run:
        run = by_name.get(name)
        if run is None:
            raise HTTPException(404, "no such run")
        return run

    @app.get("/", response_class=HTMLResponse)
    def page() -> str:
        return (static / "index.html").read_text(encoding="utf-8")

    @app.get("/static/{name}")
    def static_file(name: str) -> Response:
        if name == "plotly.min.js":
            path = plotly_js()
            if path is None:
                raise HTTPException(404, "plotly is not installed")
            return FileResponse(path, media_type="text/javascript", headers={"Cache-Control": "max-age=3600"})
        if name not in STATIC:
            raise HTTPException(404, "no such file")
        return Response((static / name).read_bytes(), media_type=STATIC[name])

    @app.get("/api/runs")
    def list_runs(background: BackgroundTasks) -> Response:
        # the page's first question: once it is answered, the judge logs' index is built on a
        # thread of its own, ready (or nearly) when a step's trajectories are first asked for
        for run in runs:
            background.add_task(run.index_judges)
        return as_json([run.summary() for run in runs])

    @app.get("/api/runs/{name}/metrics")
    def metrics(name: str, since: int = 0, generation: int = -1) -> Response:
        run = run_named(name)
        with run.lock:
            run.metrics.refresh()
            rows, now, unreadable = list(run.metrics.rows), run.metrics.generation, run.metrics.unreadable
        start = since if generation == now and 0 <= since <= len(rows) else 0
        return as_json({"generation": now, "start": start, "rows": rows[start:], "unreadable": unreadable})

    @app.get("/api/runs/{name}/steps/{step}")
    def step_groups(name: str, step: int) -> Response:
        run = run_named(name)
        out = run.step_groups(step)
        if not out["groups"]:
            raise HTTPException(404, f"no trajectories at step {step}")
        return as_json(out)

    @app.get("/api/runs/{name}/sample")
    def sample(name: str, step: int, uid: str, sample: int) -> Response:
        record = run_named(name).sample(step, uid, sample)
        if record is None:
            raise HTTPException(404, "no such sample")
        return as_json(record)

    @app.get("/api/runs/{name}/uid")
    def uid_history(name: str, uid: str) -> Response:
        return as_json(run_named(name).uid_history(uid))

    @app.get("/api/runs/{name}/answers")
    def answers(name: str, folder: str) -> Response:
        run = run_named(name)
        if folder not in run.evals():
            raise HTTPException(404, "no answers.jsonl there")
        return as_json(run.answers(folder))

    @app.get("/files/{name}/{path:path}")
    def run_file(name: str, path: str) -> Response:
        target = run_named(name).file(path)
        if target is None:
            raise HTTPException(404, "no such image in the run")
        return FileResponse(target, media_type=IMAGE_TYPES[target.suffix.lower()])

    return app
