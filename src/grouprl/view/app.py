"""The viewer's HTTP side: the page, its scripts, a JSON API over the runs and their image files.

Every route is a GET; nothing a request says is written anywhere. Files are served only from
inside a run folder and only as images (`Run.file`); the page's scripts are the package's own
(`static/`) and plotly's, from the installed plotly package: nothing comes from the network.

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
from importlib import resources
from pathlib import Path
from typing import Any

from grouprl.view.runs import IMAGE_TYPES, Run

STATIC = {"app.js": "text/javascript", "style.css": "text/css"}


def plotly_js() -> Path | None:
    """plotly.min.js as the plotly package ships it (None without plotly)."""
    import importlib.util

    spec = importlib.util.find_spec("plotly")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "package_data" / "plotly.min.js"
    return path if path.is_file() else None


def create_app(runs: list[Run]) -> Any:
    from fastapi import BackgroundTasks, FastAPI, HTTPException
    from fastapi.responses import FileResponse, HTMLResponse, Response

    app = FastAPI(title="grouprl view", docs_url=None, redoc_url=None, openapi_url=None)
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
    def list_runs(background: BackgroundTasks) -> list[dict[str, Any]]:
        # the page's first question: once it is answered, the judge logs' index is built on a
        # thread of its own, ready (or nearly) when a step's trajectories are first asked for
        for run in runs:
            background.add_task(run.index_judges)
        return [run.summary() for run in runs]

    @app.get("/api/runs/{name}/metrics")
    def metrics(name: str, since: int = 0, generation: int = -1) -> dict[str, Any]:
        run = run_named(name)
        run.metrics.refresh()
        rows, now = run.metrics.rows, run.metrics.generation
        start = since if generation == now and 0 <= since <= len(rows) else 0
        return {"generation": now, "start": start, "rows": rows[start:]}

    @app.get("/api/runs/{name}/steps/{step}")
    def step_groups(name: str, step: int) -> dict[str, Any]:
        run = run_named(name)
        out = run.step_groups(step)
        if not out["groups"]:
            raise HTTPException(404, f"no trajectories at step {step}")
        return out

    @app.get("/api/runs/{name}/sample")
    def sample(name: str, step: int, uid: str, sample: int) -> dict[str, Any]:
        record = run_named(name).sample(step, uid, sample)
        if record is None:
            raise HTTPException(404, "no such sample")
        return record

    @app.get("/api/runs/{name}/uid")
    def uid_history(name: str, uid: str) -> list[dict[str, Any]]:
        return run_named(name).uid_history(uid)

    @app.get("/api/runs/{name}/answers")
    def answers(name: str, folder: str) -> list[dict[str, Any]]:
        run = run_named(name)
        if folder not in run.evals():
            raise HTTPException(404, "no answers.jsonl there")
        return run.answers(folder)

    @app.get("/files/{name}/{path:path}")
    def run_file(name: str, path: str) -> Response:
        target = run_named(name).file(path)
        if target is None:
            raise HTTPException(404, "no such image in the run")
        return FileResponse(target, media_type=IMAGE_TYPES[target.suffix.lower()])

    return app
