"""The viewer's indexes of a large run built in-process, alternating, two ways: as `grouprl view`
builds them (a line the writers wrote read by its anchored leading fields, any other parsed
whole) and with every line parsed whole (what reading records by parsing them would cost).

    .venv/bin/python benchmarks/view_index.py                 # 500 steps x 200 trajectories
    .venv/bin/python benchmarks/view_index.py --steps 50      # a smaller run

The run is benchmarks/view.py's synthetic one (rollouts.jsonl ~3.4 KB a line, judge.jsonl one
call a trajectory), written to a temp folder; its files are in the page cache. Each build reads
the whole file from the start (nothing kept between builds). Prints seconds per build (best of
the rounds) and the ratio whole / as built.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

from grouprl.view import index as index_module
from grouprl.view.index import JudgeIndex, RolloutIndex, parse_line

sys.path.insert(0, str(Path(__file__).parent))
from view import write_run  # noqa: E402


class WholeRollouts(RolloutIndex):
    """Every line parsed whole."""

    def add(self, offset: int, line: bytes) -> None:
        step, uid = index_module._step_and_uid(parse_line(line))
        if uid is None:
            self.unreadable += 1
            return
        span = self.steps.get(step)
        if span is None:
            self.steps[step] = [offset, offset + len(line) + 1, 1]
        else:
            span[1], span[2] = offset + len(line) + 1, span[2] + 1
        seen = self.uids.setdefault(uid, [])
        if not seen or seen[-1] != step:
            seen.append(step)


class WholeJudge(JudgeIndex):
    """Every line parsed whole."""

    def add(self, offset: int, line: bytes) -> None:
        record = parse_line(line)
        if not isinstance(record, dict) or not isinstance(record.get("request_id"), str):
            self.unreadable += 1
            return
        failed = record.get("error") is not None
        self.requests.setdefault(record["request_id"], []).append([float(record["time"]), offset, len(line), failed])


def build(kind: type, path: Path) -> tuple[float, object]:
    t0 = time.perf_counter()
    index = kind(path)
    index.refresh()
    return time.perf_counter() - t0, index


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--per-step", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp()) / "big"
    try:
        write_run(folder, args.steps, args.per_step, 8)
        for name, fast, whole in (("rollouts.jsonl", RolloutIndex, WholeRollouts), ("judge.jsonl", JudgeIndex, WholeJudge)):
            path = folder / name
            path.read_bytes()  # into the page cache
            times: dict[str, list[float]] = {"as built": [], "whole": []}
            for _ in range(args.rounds):  # alternating
                seconds, a = build(fast, path)
                times["as built"].append(seconds)
                seconds, b = build(whole, path)
                times["whole"].append(seconds)
                assert a.state() == b.state() and a.unreadable == b.unreadable == 0  # the same index
            best = {k: min(v) for k, v in times.items()}
            print(f"{name} ({path.stat().st_size / 2**20:.0f} MiB): as built {best['as built']:.2f} s, every line parsed "
                  f"whole {best['whole']:.2f} s: x{best['whole'] / best['as built']:.2f}")  # fmt: skip
    finally:
        shutil.rmtree(folder.parent, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
