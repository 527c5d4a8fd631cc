"""`grouprl curriculum build` on a large synthetic log: wall time and peak memory.

    .venv/bin/python benchmarks/curriculum_build.py --records 1000000
    .venv/bin/python benchmarks/curriculum_build.py --records 200000 --array   # a JSON array log

Writes N log records in the source layout (one per agent trajectory, uid inside
`reference_documents`, score `ndcg_value`; see grouprl.curriculum.synthetic) and the matching
dataset into a temp folder, then runs the build in a child process. Printed: the log size,
the build's wall time (process start to exit, imports included), its CPU time and peak RSS
(getrusage of the waited child), the load average (other work on the machine stretches the
wall time, not the CPU time), and the summary counts. Targets at 1,000,000 records:
under 30 s and 2 GB.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from grouprl.curriculum.synthetic import write_synthetic


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=1_000_000, help="log records (trajectories)")
    parser.add_argument("--agents", type=int, default=5, help="records per uid")
    parser.add_argument(
        "--array", action="store_true", help="write the log as one JSON array instead of JSONL"
    )
    parser.add_argument(
        "--malformed-every", type=int, default=50_000, help="cut every N-th line short (0 = none)"
    )
    parser.add_argument(
        "--workdir", default=None, help="folder for the files (default: a temp folder, removed)"
    )
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as temp:
        folder = Path(args.workdir or temp)
        started = time.perf_counter()
        paths = write_synthetic(
            folder,
            args.records,
            args.agents,
            array=args.array,
            malformed_every=0 if args.array else args.malformed_every,
        )
        print(
            f"generated {args.records} records ({paths['logs'].stat().st_size / 2**20:.0f} MiB) "
            f"in {time.perf_counter() - started:.1f} s"
        )
        command = [
            sys.executable,
            "-m",
            "grouprl.curriculum.cli",
            "build",
            "--logs",
            str(paths["logs"]),
            "--dataset",
            str(paths["dataset"]),
            "--out",
            str(folder / "curriculum"),
            "--uid-field",
            "reference_documents",
            "--uid-regex",
            r"uid_(\d+)_page",
            "--score-field",
            "ndcg_value",
            "--reward-field",
            "final_score",
            "--agent-field",
            "agent_id",
        ]
        started = time.perf_counter()
        result = subprocess.run(command, capture_output=True, text=True)
        wall = time.perf_counter() - started
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # the build is the only child
        peak_rss = usage.ru_maxrss / 2**20  # Linux: KiB -> GiB
        cpu = usage.ru_utime + usage.ru_stime
        if result.returncode != 0:
            print(result.stdout + result.stderr, file=sys.stderr)
            return result.returncode
        summary = json.loads((folder / "curriculum" / "summary.json").read_text())
        load = os.getloadavg()[0]
        print(
            f"build: {wall:.1f} s wall, {cpu:.1f} s CPU, peak RSS {peak_rss:.2f} GiB (load average {load:.1f})"
        )
        print(
            f"matched {summary['matched']}, log only {summary['log_only']}, dataset only {summary['dataset_only']}, "
            f"malformed lines {summary['malformed_lines']}, buckets {summary['buckets']}"
        )
        ok = wall < 30 and peak_rss < 2
        print(f"targets (1M records: < 30 s, < 2 GiB): {'met' if ok else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
