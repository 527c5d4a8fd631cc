"""benchmarks/gpu_check.py: its summaries on hand-made metrics and rollouts lines, and its plumbing
end to end on the CPU (`--device cpu`, a tiny model): a row with figures read from its own run's
metrics.jsonl, a row that needs CUDA skipped, a row with a bad override failed in one line."""

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

from helpers import tiny_model_and_tokenizer

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"
spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
gpu_check = sys.modules["gpu_check"] = importlib.util.module_from_spec(spec)  # dataclasses look it up
spec.loader.exec_module(gpu_check)


def step(n, t, **more):
    return {"step": n, "time/step": t, **more}


# ------------------------------------------------------------------------- summaries
def test_summary_leaves_the_first_step_out_and_reads_what_exists():
    metrics = [
        {"step": 0, "val/accuracy": 0.1},  # an evaluation line: no time/step
        step(1, 9.0, **{"perf/peak_cuda_gb": 3.0, "rollout/mismatch_mean": 0.9, "rollout/mismatch_max": 5.0}),
        step(2, 2.0, **{"perf/peak_cuda_gb": 4.5, "rollout/mismatch_mean": 0.1, "rollout/mismatch_max": 0.4}),
        step(3, 4.0, **{"perf/peak_cuda_gb": 4.0, "rollout/mismatch_mean": 0.3, "rollout/mismatch_max": 0.7}),
        step(4, 3.0, **{"perf/peak_cuda_gb": 4.1, "rollout/mismatch_mean": 0.2, "time/weight_sync": 0.5}),
    ]
    s = gpu_check.summarise(metrics)
    assert (s["steps"], s["timed"], s["step_s"]) == (4, 3, 3.0)  # median of 2, 4, 3
    assert s["peak_cuda_gb"] == 4.5 and s["peak_rss_gb"] is None
    # medians over steps 2-4, the _max key's max; a key only some steps have: over those
    assert s["details"] == {
        "rollout/mismatch_mean": 0.2,
        "rollout/mismatch_max": 0.7,
        "time/weight_sync": 0.5,
    }


def test_summary_of_one_step_and_of_none():
    s = gpu_check.summarise([step(1, 7.5, **{"perf/peak_rss_gb": 1.25})])
    assert (s["steps"], s["timed"], s["step_s"], s["peak_rss_gb"]) == (1, 1, 7.5, 1.25)
    s = gpu_check.summarise([])
    assert (s["steps"], s["step_s"], s["peak_cuda_gb"], s["details"]) == (0, None, None, {})


def test_a_cut_off_last_line_is_left_out():
    text = json.dumps(step(1, 1.0)) + "\n" + json.dumps(step(2, 2.0)) + "\n" + '{"step": 3, "time/st'
    assert [m["step"] for m in gpu_check.parse_jsonl(text)] == [1, 2]


def rollout(s, uid, k, response):
    return {"step": s, "uid": uid, "sample": k, "response": response, "response_tokens": len(response)}


def test_two_ranks_against_one_process():
    one = [rollout(s, u, k, f"{s}{u}{k}") for s in (1, 2) for u in ("a", "b") for k in (0, 1)]
    assert gpu_check.compare_rollouts(one, list(reversed(one))) == (0, 8, None)
    assert gpu_check.same_responses_line(2, 0, 8, None) == "2 ranks = 1: yes (0 of 8 differ)"

    two = [dict(r) for r in one if (r["step"], r["uid"], r["sample"]) != (2, "b", 1)]  # one missing
    two[4]["response"] = "other"  # step 2, uid a, sample 0
    assert gpu_check.compare_rollouts(two, one) == (2, 8, 2)
    assert gpu_check.same_responses_line(4, 2, 8, 2) == "4 ranks = 1: no (2 of 8 differ, from step 2)"
    assert gpu_check.same_responses_line(2, 0, 0, None) == "2 ranks = 1: no (no rollouts to compare)"
    assert gpu_check.response_tokens(one) == 3.0 and gpu_check.response_tokens([]) is None


# ------------------------------------------------------------------------- failures, rows, RESULTS.md
def test_failure_reasons_are_one_line():
    reason = gpu_check.failure_reason
    assert reason("loading\ngrouprl: error: model.path 'x' does not exist\n", 2) == (
        "grouprl: error: model.path 'x' does not exist"
    )
    oom = (
        'Traceback (most recent call last):\n  File "x.py", line 1, in <module>\n'
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
    )
    assert (
        reason(oom, 1)
        == "out of memory: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    )
    torchrun = (
        "[rank1]: RuntimeError: NCCL error in: ProcessGroupNCCL.cpp\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
        "============================================\n"
    )
    assert reason(torchrun, 1) == "RuntimeError: NCCL error in: ProcessGroupNCCL.cpp"
    assert reason(torchrun.split("\n", 1)[1], 1) == (
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:"
    )
    assert reason("partial output", -9) == "killed by signal 9"
    assert reason("", 3) == "exit status 3"
    assert reason("anything", None, timed_out=900.0) == "time limit of 900 s reached"
    assert len(reason("ValueError: " + "x" * 500, 1)) == 200


def test_rows_groups_and_sets():
    assert [r.name for r in gpu_check.select_rows("default,vlm")] == ["bf16", "fp32", "vlm"]
    assert [r.name for r in gpu_check.select_rows("vllm2,ranks")] == ["ranks", "vllm2"]
    assert [r.name for r in gpu_check.select_rows("async")] == ["async", "asyncproc", "asyncsplit", "asyncservice"]
    assert len(gpu_check.select_rows("all")) == len(gpu_check.ROWS)
    with pytest.raises(ValueError, match="unknown row 'bogus'"):
        gpu_check.select_rows("bf16,bogus")
    every, per_row = gpu_check.split_sets(
        ["model.path=builtin:smollm2-135m-instruct", "vllm1:rollout.gpu_memory_utilization=0.3"]
    )
    assert every == ["model.path=builtin:smollm2-135m-instruct"]  # a colon in the value is a value
    assert per_row == {"vllm1": ["rollout.gpu_memory_utilization=0.3"]}
    with pytest.raises(ValueError, match="unknown row 'nope'"):
        gpu_check.split_sets(["nope:actor.dtype=float32"])
    assert gpu_check.ranks_batch(2) == 4 and gpu_check.ranks_batch(3) == 6 and gpu_check.ranks_batch(8) == 8


def test_skip_reasons():
    rows = {r.name: r for r in gpu_check.ROWS}
    skip = gpu_check.skip_reason
    assert skip(rows["bf16"], "cpu", 0, {}) is None
    assert skip(rows["vlm"], "cuda", 1, {}) is None
    assert skip(rows["lora4bit"], "cpu", 0, {}) == "needs CUDA (this run: --device cpu)"
    assert skip(rows["ranks"], "cuda", 1, {}) == "needs 2 or more GPUs (1 visible)"
    assert skip(rows["ranks"], "cuda", 2, {}) is None
    assert skip(rows["asyncproc"], "cuda", 1, {}) is None
    assert skip(rows["asyncsplit"], "cuda", 1, {}) == "needs 2 or more GPUs (1 visible)"
    assert "rollout.engine_device=cuda:1" in rows["asyncsplit"].overrides
    missing = {"vllm": "ModuleNotFoundError: No module named 'vllm'"}
    assert skip(rows["vllm0"], "cuda", 1, missing) == (
        "vllm does not import (ModuleNotFoundError: No module named 'vllm')"
    )
    assert skip(rows["lora4bit"], "cuda", 1, {"bitsandbytes": None}) is None
    assert [r.name for r in gpu_check.select_rows("shard")] == ["zero3", "offloadstart", "export"]
    assert skip(rows["zero3"], "cuda", 1, {}) is None and skip(rows["export"], "cpu", 0, {}) is None
    assert skip(rows["offloadstart"], "cuda", 1, {}) == "needs 2 or more GPUs (1 visible)"


def test_export_line_reads_the_folders_safetensors_headers(tmp_path):
    import torch
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(2, 3, dtype=torch.bfloat16)}, str(tmp_path / "model-1.safetensors"))
    save_file({"b": torch.zeros(5, dtype=torch.bfloat16)}, str(tmp_path / "model-2.safetensors"))
    size = sum(p.stat().st_size for p in tmp_path.iterdir())
    assert gpu_check.export_line(tmp_path) == f"final/: BF16, {size / 1e9:.2f} GB in 2 file(s)"
    save_file({"c": torch.zeros(1)}, str(tmp_path / "model-3.safetensors"))
    assert gpu_check.export_line(tmp_path).startswith("final/: BF16/F32, ")
    assert gpu_check.export_line(tmp_path / "nothing") == ""


def test_the_section_goes_inside_the_gpu_check_section():
    before = "# Results\n\n## A\n\ntext a\n\n"
    page = (
        f"{before}{gpu_check.HEADER}\n\nCommand and what it runs.\n\n{gpu_check.NOT_RUN}\n\n## B\n\ntext b\n"
    )
    once = gpu_check.insert_section(page, "### day 1\n\n| t |\n")
    assert (
        once
        == f"{before}{gpu_check.HEADER}\n\nCommand and what it runs.\n\n### day 1\n\n| t |\n\n## B\n\ntext b\n"
    )
    twice = gpu_check.insert_section(once, "### day 2\n")
    assert twice.index("### day 1") < twice.index("### day 2") < twice.index("## B")
    # at the end of the page, and on a page without the section
    assert gpu_check.insert_section(f"# R\n\n{gpu_check.HEADER}\n\n{gpu_check.NOT_RUN}\n", "### d\n") == (
        f"# R\n\n{gpu_check.HEADER}\n\n### d\n"
    )
    assert gpu_check.insert_section("# R\n", "### d\n") == f"# R\n\n{gpu_check.HEADER}\n\n### d\n"
    assert gpu_check.insert_section("", "### d\n") == f"{gpu_check.HEADER}\n\n### d\n"


# ------------------------------------------------------------------------- the plumbing, on the CPU
@pytest.mark.slow
def test_the_matrix_on_the_cpu(tmp_path, capsys):
    model = tmp_path / "model"
    tiny_model_and_tokenizer(model, init_std=0.02)
    data = tmp_path / "d.jsonl"
    data.write_text(
        "".join(
            json.dumps({"id": f"q{i}", "question": f"{i}+1?", "answer": str(i + 1)}) + "\n" for i in range(4)
        )
    )
    out, work = tmp_path / "RESULTS.md", tmp_path / "work"
    out.write_text(f"# Benchmark results\n\n{gpu_check.HEADER}\n\n{gpu_check.NOT_RUN}\n\n## Next\n")
    argv = [
        "--device", "cpu", "--rows", "bf16,fp32,lora4bit,ranks", "--steps", "2", "--out", str(out),
        "--work", str(work), "--set", f"model.path={model}", "--set", f"data.train_files=[{data}]",
        "--set", "reward.components=[{name: contains_integer}]", "--set", "reward.val_metric=contains_integer",
        "--set", "rollout.max_response_length=4", "--set", "data.train_batch_size=2", "--set", "rollout.n_agent=2",
        "--set", "fp32:actor.dtype=bogus",
    ]  # fmt: skip
    assert gpu_check.main(argv) == 1  # a row failed; the others ran
    printed = capsys.readouterr().out

    metrics = [json.loads(line) for line in (work / "bf16" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "time/step" in m]
    assert [m["step"] for m in steps] == [1, 2]
    rows = {
        line.split(" | ")[0][2:]: line.split(" | ") for line in printed.splitlines() if line.startswith("| ")
    }
    bf16 = rows["bf16"]
    assert bf16[2:5] == ["ok", "2 (1)", f"{steps[1]['time/step']:.3f}"]  # step 2 only: step 1 is warm-up
    assert bf16[5] == "-"  # no CUDA peak on a CPU; the RSS peak is in the details
    assert f"rollout/mismatch_mean {steps[1]['rollout/mismatch_mean']:.4g}" in bf16[6]
    assert f"peak RSS {max(m['perf/peak_rss_gb'] for m in steps):.2f} GB" in bf16[6]

    fp32 = rows["fp32"][2]
    assert fp32.startswith("failed: grouprl: error: config key 'actor.dtype' must be one of")
    assert "\n" not in fp32 and (work / "fp32.log").is_file()
    assert rows["lora4bit"][2] == "skipped: needs CUDA (this run: --device cpu)"
    assert rows["ranks"][2] == "skipped: needs CUDA (this run: --device cpu)"

    page = out.read_text()
    assert gpu_check.NOT_RUN not in page
    assert page.index(gpu_check.HEADER) < page.index(": CPU (plumbing only)")
    assert page.index("| bf16 | ") < page.index("## Next")
    assert "python benchmarks/gpu_check.py --device cpu --rows bf16,fp32,lora4bit,ranks" in page
    assert "- fp32 (2 steps): `grouprl train rollout.check_log_probs=true actor.dtype=float32" in page


@pytest.mark.slow
def test_no_write_and_nothing_by_default_on_the_cpu(tmp_path, capsys, monkeypatch):
    out = tmp_path / "RESULTS.md"
    monkeypatch.setattr(gpu_check, "RESULTS", tmp_path / "default-RESULTS.md")
    argv = ["--device", "cpu", "--rows", "lora4bit", "--work", str(tmp_path / "w")]
    assert gpu_check.main([*argv, "--out", str(out), "--no-write"]) == 0
    assert not out.exists() and (tmp_path / "w" / "section.md").is_file()  # kept with the runs
    assert gpu_check.main(argv) == 0  # no --out on a CPU: the default page is not written
    assert not gpu_check.RESULTS.exists()
    assert "| lora4bit | " in capsys.readouterr().out


@pytest.mark.slow
def test_the_engine_service_row_serves_its_run_from_a_service_of_its_own(tmp_path, monkeypatch):
    """`asyncservice` (on the CPU here): a `grouprl engine serve` started for the row, the run's
    engine there (`rollout.engine_address`, the key through the environment), stopped after it."""
    monkeypatch.setenv("GROUPRL_ENGINE_KEY", "a-key-for-this-test-of-32-chars-at-least")
    model = tmp_path / "model"
    tiny_model_and_tokenizer(model, init_std=0.02)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i}", "question": f"{i}+1?", "answer": str(i + 1)}) + "\n" for i in range(4)))
    row = {r.name: r for r in gpu_check.ROWS}["asyncservice"]
    overrides = [
        *gpu_check.common_overrides(3, "cpu"), f"model.path={model}", f"data.train_files=[{data}]",
        "reward.components=[{name: contains_integer}]", "reward.val_metric=contains_integer",
        "rollout.max_response_length=4", "data.train_batch_size=2", "rollout.n_agent=2", *row.overrides,
    ]  # fmt: skip
    result = gpu_check.run_row(row, overrides, tmp_path, 300, 0, device="cpu")
    assert result.status == "ok", result.reason
    assert result.summary["steps"] == 3 and result.details[-1] == "engine service on cpu"
    # the run's memory plan against what it measured (asynchronous: the update's peak holds generation's)
    assert re.fullmatch(r"plan/measured GiB: startup [\d.]+/[\d.]+, generation [\d.]+/-, update [\d.]+/[\d.]+", result.details[0])
    versions = [m["rollout/policy_version"] for m in gpu_check.step_records(gpu_check.read_jsonl(tmp_path / "asyncservice" / "metrics.jsonl"))]
    assert versions == [0, 0, 1]  # one step off policy, sampled there
    assert "engine on cpu for 127.0.0.1:" in (tmp_path / "asyncservice-service.log").read_text()
    assert "a-key-for-this-test-of-32-chars-at-least" not in "".join(p.read_text(errors="replace") for p in tmp_path.rglob("*.log"))


@pytest.mark.slow
def test_quick_runs_the_leases_rows_within_its_budget_on_a_random_smollm2(tmp_path, monkeypatch):
    """--quick on the CPU (the plumbing): the recipe rows train SmolLM2-135M's architecture with
    random weights built here (the built-in model's package is too large to take to a lent GPU),
    rows that need CUDA are skipped, the scale row reports its figures from scale.py (toy models
    here), each within the row limit; the table says it all. (SmolLM2's shape shrunk here: what
    is checked is the plumbing, not the model.)"""
    spec = importlib.util.spec_from_file_location("scale", SCRIPT.parent / "scale.py")
    scale = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(scale)
    monkeypatch.setitem(sys.modules, "scale", scale)  # the module gpu_check imports
    real = scale.model_config
    monkeypatch.setattr(scale, "model_config", lambda name, toy: real(name, toy=True))
    code = gpu_check.main([
        "--device", "cpu", "--quick", "--model", "random", "--steps", "1", "--work", str(tmp_path), "--no-write",
        "--set", "bf16:rollout.max_response_length=8", "--set", "bf16:data.train_batch_size=2",
        "--set", "bf16:rollout.n_agent=2",
    ])  # fmt: skip
    assert code == 0
    section = (tmp_path / "section.md").read_text()
    rows = {line.split(" | ")[0].strip("| "): line for line in section.splitlines() if line.startswith("| ") and " | " in line}
    assert set(rows) >= {"bf16", "async", "asyncproc", "scale"}
    assert "| ok |" in rows["bf16"] and "plan/measured GiB: startup" in rows["bf16"]
    assert "skipped: needs CUDA" in rows["async"] and "skipped: needs CUDA" in rows["asyncproc"]
    assert "| ok |" in rows["scale"] and "generation" in rows["scale"] and "tok/s" in rows["scale"]
    assert (tmp_path / "smollm2-135m-random" / "tokenizer" / "tokenizer.json").is_file()
    assert "model.path=" in section and "data.few_shot=false" in section
