"""Judge throughput: N judge calls at a fixed server latency with a concurrency cap, against the ideal.

    .venv/bin/python benchmarks/judge_concurrency.py [--calls 512 --latency 0.2 --cap 50 --sequential 20]

The fake OpenAI-compatible judge (tests/rewards/judges/fake_server.py) runs in a separate process,
so its CPU time does not compete with the client's under one interpreter lock. The client is the
full `JudgeClient` path a training run uses (prompt rendering, HTTP, parsing, judge.jsonl off,
cache off so every call is a request). Every call has a distinct prompt.

Printed: the wall time of the N concurrent calls against the ideal ceil(N / cap) x latency; the
server's highest in-flight count (must equal the cap, never exceed it); the CPU time per call of
the client process and of the server process during the concurrent runs (a wave of `cap` answers
is processed one after the other on the client's event loop, so cap x client CPU per call must
stay well below the latency); the sequential rate measured on a subset (`--sequential` calls with
cap 1) and extrapolated to N calls; and the sequential / concurrent ratio. Rounds alternate
concurrent and sequential runs; the median is kept.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from grouprl.config import JudgeConfig
from grouprl.rewards.judges import JudgeClient, JudgeRequest

FAKE_JUDGE = Path(__file__).resolve().parents[1] / "tests" / "rewards" / "judges" / "fake_server.py"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=512, help="concurrent judge calls per round")
    p.add_argument("--latency", type=float, default=0.2, help="server latency per call, seconds")
    p.add_argument("--cap", type=int, default=50, help="max_concurrent_requests")
    p.add_argument("--sequential", type=int, default=20, help="calls measured one at a time (extrapolated)")
    p.add_argument("--rounds", type=int, default=3, help="alternating concurrent/sequential rounds")
    return p.parse_args()


def start_server(latency: float) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen(
        [sys.executable, str(FAKE_JUDGE), "--latency", str(latency)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    base_url = process.stdout.readline().strip()
    if not base_url.startswith("http"):
        process.kill()
        raise SystemExit(f"fake judge server did not start: {base_url!r}")
    return process, base_url


def server_stats(base_url: str, reset: bool = True) -> dict:
    """The server's counters (requests, max_in_flight), read and reset over HTTP."""
    url = base_url.rsplit("/v1", 1)[0] + ("/stats?reset=1" if reset else "/stats")
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_calls(base_url: str, cap: int, count: int, tag: str) -> float:
    cfg = JudgeConfig(
        name=f"bench-{tag}", base_url=base_url, model="fake", cache_path="", max_concurrent_requests=cap
    )
    client = JudgeClient(cfg)
    requests = [JudgeRequest(question=f"{tag} question {i}", response=f"GRADE:{i % 6}") for i in range(count)]
    try:
        client.judge_many(requests[:1])  # connect once outside the timing
        started = time.perf_counter()
        results = client.judge_many(requests[1:] + [JudgeRequest(question=f"{tag} last", response="GRADE:1")])
        elapsed = time.perf_counter() - started
    finally:
        client.close()
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise SystemExit(f"{len(failed)} judge calls failed, e.g. {failed[0]}")
    return elapsed


def main() -> None:
    args = parse_args()
    process, base_url = start_server(args.latency)
    try:
        ideal = math.ceil(args.calls / args.cap) * args.latency
        concurrent, sequential, peaks, client_cpu, server_cpu = [], [], [], [], []
        for round_index in range(args.rounds):
            order = ("concurrent", "sequential") if round_index % 2 == 0 else ("sequential", "concurrent")
            for kind in order:
                before = server_stats(base_url)
                if kind == "concurrent":
                    cpu = cpu_seconds()
                    concurrent.append(run_calls(base_url, args.cap, args.calls, f"c{round_index}"))
                    client_cpu.append((cpu_seconds() - cpu) / args.calls)
                    after = server_stats(base_url)
                    peaks.append(after["max_in_flight"])
                    server_cpu.append((after["cpu_s"] - before["cpu_s"]) / args.calls)
                    print(f"round {round_index}: {args.calls} calls, cap {args.cap}: {concurrent[-1]:.3f} s")
                else:
                    sequential.append(run_calls(base_url, 1, args.sequential, f"s{round_index}"))
                    print(f"round {round_index}: {args.sequential} sequential calls: {sequential[-1]:.3f} s")
    finally:
        process.terminate()
        process.wait(timeout=10)
    concurrent_s = statistics.median(concurrent)
    sequential_s = statistics.median(sequential) / args.sequential * args.calls
    print(
        f"concurrent: {concurrent_s:.3f} s (median of {len(concurrent)}); ideal ceil({args.calls}/{args.cap}) x "
        f"{args.latency:g} s = {ideal:.3f} s; overhead {100 * (concurrent_s / ideal - 1):+.1f}%"
    )
    print(f"server max in flight: {max(peaks)} (cap {args.cap})")
    print(
        f"CPU per call: client {1e3 * statistics.median(client_cpu):.2f} ms, "
        f"server {1e3 * statistics.median(server_cpu):.2f} ms (medians; the client's includes its connections)"
    )
    print(
        f"sequential: {sequential_s:.3f} s for {args.calls} calls (measured on {args.sequential}, extrapolated)"
    )
    print(f"sequential / concurrent: {sequential_s / concurrent_s:.1f}x")


if __name__ == "__main__":
    main()
