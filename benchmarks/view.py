"""`grouprl view` on a large run: how long it takes to open, and to page through steps.

    .venv/bin/python benchmarks/view.py                      # 500 steps x 200 trajectories
    .venv/bin/python benchmarks/view.py --steps 50 --keep runs/big   # a smaller one, kept

Writes a synthetic run in the trainer's formats (metrics.jsonl with ~60 keys a step;
rollouts.jsonl with three agent turns a trajectory, each naming its page; judge.jsonl with one
call a trajectory, its rendered prompt and raw reply) into a temp folder, then times, each in
a fresh `grouprl view` process, from its start to the first answer of /api/runs (imports
included): the first open (the index is built) and a second one (the index is read back).
Against that server it times paging through steps (a step's groups), a sample with its judge
call, a uid followed across steps, and the metrics. The run's files are fresh in the page
cache, as they are for a run being written. The first open is timed twice, each from no index:
its first step asked for at once and 1 s later (the judge log's index is built in the background
once /api/runs is answered). Target: open under 2 s.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

WORDS = "page slide revenue quarter figure table chart search answer region growth total the of in".split()


def text(rng: random.Random, chars: int) -> str:
    out, size = [], 0
    while size < chars:
        word = rng.choice(WORDS)
        out.append(word)
        size += len(word) + 1
    return " ".join(out)


def write_run(folder: Path, steps: int, per_step: int, n_agent: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    keys = [f"{part}/{k}" for part in ("actor", "reward", "response", "rollout", "perf", "time") for k in range(10)]
    with open(folder / "metrics.jsonl", "w") as f:
        for step in range(1, steps + 1):
            f.write(json.dumps({"step": step, **{k: rng.random() for k in keys}}) + "\n")
    uids = [f"q{k}" for k in range(max(1, steps * per_step // n_agent // 4))]  # each prompt drawn ~4 times
    when = 1.0e9
    with open(folder / "rollouts.jsonl", "w") as rollouts, open(folder / "judge.jsonl", "w") as judge:
        for step in range(1, steps + 1):
            lines, calls = [], []
            for group in range(per_step // n_agent):
                uid = uids[(step * 7919 + group) % len(uids)]
                for sample in range(n_agent):
                    when += 0.001
                    turns = [
                        {"turn": k, "text": text(rng, 120), "action": ("search", "bbox", "answer")[k],
                         "argument": text(rng, 40), "observation": text(rng, 300), "error": None, "tokens": 40,
                         "masked_tokens": 90, "finish_reason": "stop", "images": 1, "image_files": [],
                         "page": f"images/pages/p{rng.randrange(500)}_0123456789.png", "page_size": [640, 360]}
                        for k in range(3)
                    ]  # fmt: skip
                    reward = rng.random()
                    lines.append(json.dumps({
                        "run": "big", "step": step, "uid": uid, "sample": sample, "prompt": text(rng, 300),
                        "response": text(rng, 600), "turns": turns, "retrieved": [f"d{rng.randrange(9999)}" for _ in range(3)],
                        "rewards": {"judge": reward, "format": 1.0}, "reward": reward, "advantage": reward - 0.5,
                        "response_tokens": 260, "truncated": False, "finish_reason": "stop", "version": step - 1,
                        "ground_truth": text(rng, 20), "time": when + 1,
                    }))  # fmt: skip
                    calls.append(json.dumps({
                        "time": when, "judge": "grader", "request_id": f"{uid}/{sample}", "model": "m",
                        "prompt": {"system": text(rng, 400), "user": text(rng, 900), "images": 2},
                        "latency_s": 0.5, "prompt_tokens": 900, "completion_tokens": 60, "raw": text(rng, 200),
                        "scores": {"correctness": 1}, "aggregate": 1.0, "error": None, "cached": False, "attempts": 1,
                    }))  # fmt: skip
            when += 1
            rollouts.write("\n".join(lines) + "\n")
            judge.write("\n".join(calls) + "\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def open_viewer(folder: Path) -> tuple[subprocess.Popen, str, float]:
    """A `grouprl view` process and the seconds from its start to the first /api/runs answer."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "grouprl", "view", str(folder), "--port", str(port)],
                               stdout=subprocess.DEVNULL)  # fmt: skip
    while True:
        try:
            if httpx.get(url + "/api/runs", timeout=5).status_code == 200:
                return process, url, time.perf_counter() - started
        except httpx.TransportError:
            pass
        if process.poll() is not None:
            raise SystemExit(f"grouprl view ended with status {process.returncode}")
        time.sleep(0.02)


def timed(url: str, paths: list[str]) -> list[float]:
    seconds = []
    with httpx.Client(base_url=url, timeout=60) as client:
        for path in paths:
            t0 = time.perf_counter()
            answer = client.get(path)
            seconds.append(time.perf_counter() - t0)
            assert answer.status_code == 200, (path, answer.status_code)
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--per-step", type=int, default=200, help="trajectories a step")
    parser.add_argument("--n-agent", type=int, default=8, help="samples a group")
    parser.add_argument("--keep", default="", help="write the run here and keep it (default: a temp folder)")
    args = parser.parse_args()
    folder = Path(args.keep) if args.keep else Path(tempfile.mkdtemp()) / "big"
    t0 = time.perf_counter()
    write_run(folder, args.steps, args.per_step, args.n_agent)
    sizes = {name: (folder / name).stat().st_size / 2**20 for name in ("rollouts.jsonl", "judge.jsonl", "metrics.jsonl")}
    print(f"run: {args.steps} steps x {args.per_step} = {args.steps * args.per_step} trajectories, "
          + ", ".join(f"{k} {v:.0f} MiB" for k, v in sizes.items()) + f" (written in {time.perf_counter() - t0:.1f} s)")  # fmt: skip
    try:
        for wait in (0.0, 1.0):  # the first step asked for at once, then as a user would: a second later
            shutil.rmtree(folder / ".view", ignore_errors=True)
            process, url, seconds = open_viewer(folder)
            print(f"first open (index built): {seconds:.2f} s from process start to the first /api/runs answer")
            time.sleep(wait)
            built = timed(url, ["/api/runs/big/steps/1"])
            print(f"the first step's groups {wait:.0f} s after the first open: {built[0]:.2f} s "
                  "(the judge log's index, built in the background since /api/runs, waited for)")  # fmt: skip
            process.terminate()
            process.wait()
        process, url, seconds = open_viewer(folder)
        print(f"second open (index read back): {seconds:.2f} s from process start to the first /api/runs answer")
        rng = random.Random(1)
        steps = [rng.randrange(1, args.steps + 1) for _ in range(31)]
        first_step = timed(url, [f"/api/runs/big/steps/{steps.pop()}"])
        print(f"the first step's groups after the second open: {first_step[0]:.2f} s (the judge log's index read back)")
        step_s = timed(url, [f"/api/runs/big/steps/{s}" for s in steps])
        print(f"a step's groups ({args.per_step} trajectories): median {statistics.median(step_s) * 1e3:.0f} ms, max {max(step_s) * 1e3:.0f} ms (30 random steps)")
        first = httpx.get(f"{url}/api/runs/big/steps/{steps[0]}").json()["groups"][0]
        sample_s = timed(url, [f"/api/runs/big/sample?step={steps[0]}&uid={first['uid']}&sample={k}" for k in range(args.n_agent)])
        print(f"a sample with its turns and judge call: median {statistics.median(sample_s) * 1e3:.0f} ms")
        uid_s = timed(url, [f"/api/runs/big/uid?uid={first['uid']}"])
        print(f"a uid across the steps it was drawn at: {uid_s[0] * 1e3:.0f} ms")
        metrics_s = timed(url, ["/api/runs/big/metrics"])
        print(f"all metrics ({args.steps} rows): {metrics_s[0] * 1e3:.0f} ms")
        process.terminate()
        process.wait()
    finally:
        if not args.keep:
            shutil.rmtree(folder.parent, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
