"""What a run says while it runs and what an evaluation leaves behind: plain progress lines per
step and per evaluation chunk when the output is not a terminal, `grouprl eval`'s answers.jsonl
(one line per held-out sample, pairing two models line by line), and the time limit, which
counts training steps and not the baseline evaluation."""

import io
import json
import re
import time

import pytest
from rich.console import Console
from tiny import tiny_model_dir, write_dataset, write_run_config

from grouprl.cli import main
from grouprl.config import load_config
from grouprl.trainer.loggers import ConsoleLogger
from grouprl.trainer.trainer import Trainer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model")


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


# ------------------------------------------------------------------------- console
def test_without_a_terminal_each_step_is_a_line_when_it_happens():
    out = io.StringIO()
    console = ConsoleLogger(3, console=Console(file=out))  # a file: not a terminal
    console.log({"reward/mean": 0.25, "time/step": 2.0}, 1)
    assert out.getvalue().startswith("step 1/3 0:00:00 eta 0:00:00 reward 0.25 s/step 2\n")  # before close
    console.chunk(2, 4)
    assert out.getvalue().splitlines()[-1] == "eval 2/4 0:00:00"
    console.print("a line longer than the eighty columns rich assumes for a file " * 2)
    assert len(out.getvalue().splitlines()) == 3  # not wrapped
    console.close()
    assert len(out.getvalue().splitlines()) == 3  # and no bar at the end


def test_on_a_terminal_it_is_a_bar():
    out = io.StringIO()
    console = ConsoleLogger(3, console=Console(file=out, force_terminal=True, width=100))
    console.log({"reward/mean": 0.25}, 1)
    console.chunk(1, 2)
    console.chunk(2, 2)
    console.close()
    assert "step 1/3" in out.getvalue() and "━" in out.getvalue() and "step 1/3 0:00:00" not in out.getvalue()


def test_fit_prints_steps_and_evaluation_chunks_as_they_happen(tmp_path, model_dir, capsys):
    trainer = Trainer(load_config(write_run_config(tmp_path, model_dir), [
        "trainer.total_steps=2", "trainer.loggers=[console]", "rollout.gen_batch_size=2",
    ]))
    trainer.fit()
    lines = capsys.readouterr().out.splitlines()
    progress = [m.group(0) for m in map(re.compile(r"^(step|eval) \d+/\d+").match, lines) if m]
    # 4 held-out prompts in chunks of 2 before and after training, a line per step in between
    assert progress == ["eval 2/4", "eval 4/4", "step 0/2", "step 1/2", "step 2/2", "eval 2/4", "eval 4/4", "step 2/2"]
    assert lines[-1].startswith("eval accuracy: baseline ")


# ------------------------------------------------------------------------- grouprl eval
def test_eval_writes_every_answer_and_two_models_pair_up(tmp_path, model_dir, capsys):
    other = tiny_model_dir(tmp_path / "other", seed=1, init_std=1.0)  # answers unlike the first one's
    val = write_dataset(tmp_path / "held_out.jsonl", 5, prefix="v")
    rows = read_jsonl(val)
    rows[2]["question"] = "what is " + "1+" * 40 + "1?"  # over data.max_prompt_length: skipped, still a line
    val.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = write_run_config(tmp_path, model_dir)
    for name, model in (("a", model_dir), ("b", other)):
        code = main(["eval", str(config), f"model.path={model}", f"data.val_files=[{val}]",
                     f"trainer.eval_dir={tmp_path / name}"])
        out = capsys.readouterr().out
        assert code == 0 and out.splitlines()[-1] == f"answers: {tmp_path / name / 'answers.jsonl'}"
    a, b = read_jsonl(tmp_path / "a" / "answers.jsonl"), read_jsonl(tmp_path / "b" / "answers.jsonl")
    assert [r["uid"] for r in a] == [r["uid"] for r in b] == ["v0", "v1", "v2", "v3", "v4"]
    assert [r["skipped"] for r in a] == [False, False, True, False, False]
    assert a[2]["response"] is None and [r["response"] for r in a] != [r["response"] for r in b]
    assert set(a[0]) == {"uid", "prompt", "response", "rewards", "reward", "accuracy", "ground_truth",
                         "response_tokens", "finish_reason", "skipped"}
    assert a[0]["prompt"] == "what is 0+0?" and a[0]["ground_truth"] == "0" and set(a[0]["rewards"]) == {"a"}
    metrics = json.loads((tmp_path / "a" / "metrics.json").read_text())
    scores = [r["accuracy"] for r in a if not r["skipped"]]
    assert metrics["val/accuracy"] == pytest.approx(sum(scores) / 4)
    assert metrics["model"] == str(model_dir) and (metrics["samples"], metrics["answered"]) == (5, 4)


def test_eval_without_held_out_data_is_one_line(tmp_path, model_dir, capsys):
    config = write_run_config(tmp_path, model_dir, data={"val_files": []})
    assert main(["eval", str(config)]) == 2
    assert capsys.readouterr().err == (
        "grouprl: error: grouprl eval needs held-out data: data.val_files, or a built-in task's "
        "data.task_val_size > 0\n"
    )


# ------------------------------------------------------------------------- time limit
@pytest.mark.slow
def test_the_time_limit_counts_training_steps_not_the_baseline(tmp_path, model_dir, monkeypatch, capsys):
    """A baseline evaluation longer than the limit still leaves the steps their time."""
    evaluate, train_step = Trainer.evaluate, Trainer.train_step

    def slow_baseline(self, *args, **kwargs):
        if self.step == 0:
            time.sleep(1.5)
        return evaluate(self, *args, **kwargs)

    def slow_step(self):
        time.sleep(1.5)
        return train_step(self)

    monkeypatch.setattr(Trainer, "evaluate", slow_baseline)
    monkeypatch.setattr(Trainer, "train_step", slow_step)
    trainer = Trainer(load_config(write_run_config(tmp_path, model_dir), ["trainer.max_time_minutes=0.02"]))
    summary = trainer.fit()
    assert summary["steps"] == 1  # 1.2 s: the first step starts, the second does not
    assert [h["step"] for h in summary["history"]] == [0, 1]  # evaluated after stopping
    assert (
        "time limit of 0.02 min reached at step 1 (training time; the baseline evaluation is not counted)"
        in capsys.readouterr().out
    )
