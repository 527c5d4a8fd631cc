"""`grouprl <verb>` through `grouprl.cli.main`: the dry-run plan, --explain, and user mistakes
as one line on stderr with status 2, caught before any model loads."""

import json
import logging
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import grouprl.trainer.setup as run_setup
from grouprl.cli import main
from helpers import tiny_model_and_tokenizer


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(capsys, *argv) -> str:
    code, out, err = run(capsys, *argv)
    assert code == 2, (out, err)
    assert err.startswith("grouprl: error: ") and err.endswith("\n")
    assert err.count("\n") == 1, err  # one line, no traceback
    return err[len("grouprl: error: ") : -1]


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if anything tries to load a model or tokenizer."""

    def forbidden(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(run_setup, "load_causal_lm", forbidden)
    monkeypatch.setattr(run_setup, "load_tokenizer", forbidden)
    monkeypatch.setattr(run_setup, "resolve_model_path", forbidden)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


ROWS = [{"id": f"q{i}", "question": f"what is {i}+1?", "answer": str(i + 1)} for i in range(4)]


# ------------------------------------------------------------------------- dry run, explain
def test_dry_run_prints_the_plan_of_the_default_recipe(capsys, no_model_load):
    code, out, err = run(capsys, "train", "--dry-run")
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0] == "config is valid. plan:"
    assert "  batch: 4 prompts x 8 samples = 32 trajectories per step" in lines
    assert "  update: 1 epoch(s) x 1 mini-batch(es) of 4 prompts (32 samples) = 1 optimizer steps per training step" in lines
    assert "  micro-batches: 16 samples -> 2 accumulation step(s) per mini-batch" in lines
    assert any(line.startswith("  loss: gspo (clip 0.9997..1.0004, seq-mean-token-mean), advantages: grpo") for line in lines)
    assert any("policy: builtin:smollm2-135m-instruct [built-in (SmolLM2-135M-Instruct.Q4_1.gguf" in line for line in lines)
    assert "  reference: none (no KL term)" in lines
    assert (
        "  engine-trainer correction: token ratios truncated at 2 wherever the engine's numbers can differ "
        "from the update's (bf16, vLLM); off in float32 on the built-in engine"
    ) in lines
    assert not any("WARNING" in line for line in lines)
    assert "  reward: 1 x correctness + 0.1 x soft_format (streamed per group)" in lines
    assert any(line.startswith("  run: 20 steps, save every 10") for line in lines)
    assert "  rollout: built-in engine over the trainer's own weights, on every rank (one here; torchrun/Ray: one per rank)" in lines


def test_dry_run_of_the_source_recipe_shows_vllm_on_every_rank(capsys, no_model_load, monkeypatch):
    """configs/source_phase2.yaml as torchrun starts it on 8 GPUs (WORLD_SIZE), its paths absent here."""
    monkeypatch.setenv("WORLD_SIZE", "8")
    config = Path(__file__).resolve().parents[1] / "configs" / "source_phase2.yaml"
    code, out, err = run(capsys, "train", str(config), "--dry-run")
    assert code == 0 and err == ""
    assert (
        "  rollout: vLLM in-process, one engine on each of the 8 ranks, on that rank's GPU with the whole model "
        "(tensor parallel 1), 80% of the GPU; between rollouts (CUDA) sleep level 2: weights and KV cache freed; "
        "CUDA graphs"
    ) in out.splitlines()
    assert "reward: 0.8 x judge + 0.2 x ndcg; judges: gemini (openai gemini-2.5-flash) (streamed per group)" in out
    # one step off policy: the engines generate ahead of the update
    code, out, err = run(capsys, "train", "--dry-run", str(config), "rollout.max_staleness=1", "rollout.sleep_level=0")
    assert code == 0 and err == ""
    assert (
        "  rollout: vLLM in-process, one engine on each of the 8 ranks, on that rank's GPU with the whole model "
        "(tensor parallel 1), 80% of the GPU; between rollouts (CUDA) sleep level 0: awake throughout; "
        "CUDA graphs; asynchronous: up to 1 step(s) ahead of the update (fixed_lag), on a thread of its own over a "
        "whole copy of the policy on each rank"
    ) in out.splitlines()
    for overrides, ending in (
        (
            ["rollout.max_staleness=2", "rollout.engine_process=true"],
            "asynchronous: up to 2 step(s) ahead of the update (fixed_lag), in an engine process of its own on the "
            "trainer device (weights over its pipe, NCCL between GPUs) over a whole copy of the policy on each rank",
        ),
        (
            ["rollout.max_staleness=1", "rollout.engine_address=10.0.0.2:7100"],
            "in an engine process of the engine service at 10.0.0.2:7100 (weights over the authenticated connection, NCCL between GPUs) over a "
            "whole copy of the policy on each rank",
        ),
    ):
        code, out, err = run(capsys, "train", "--dry-run", str(config), "rollout.sleep_level=0", *overrides)
        assert code == 0 and err == ""
        assert any(line.endswith(ending) for line in out.splitlines())


def test_dry_run_follows_overrides_and_warns_about_missing_data(capsys, tmp_path, no_model_load):
    data = write_jsonl(tmp_path / "d.jsonl", ROWS)
    code, out, _ = run(
        capsys, "train", "--dry-run", "data.train_batch_size=6", "rollout.n_agent=3", "actor.mini_batch_size=2",
        "actor.micro_batch_size=4", "actor.ppo_epochs=2", f"data.train_files=[{data}, {tmp_path}/gone.jsonl]",
        "model.lora.rank=8", "actor.kl_loss_coef=0.01",
    )
    assert code == 0
    assert "batch: 6 prompts x 3 samples = 18 trajectories per step" in out
    assert "update: 2 epoch(s) x 3 mini-batch(es) of 2 prompts (6 samples) = 6 optimizer steps per training step" in out
    assert "micro-batches: 4 samples -> 2 accumulation step(s) per mini-batch" in out
    assert "LoRA r=8 alpha=16" in out
    assert "reference: base model with adapters disabled (kl_coef=0, kl_loss_coef=0.01)" in out
    assert f"data: {data}: plain layout: question, answer\n" in out
    assert f"data: {tmp_path}/gone.jsonl  [WARNING: not found]" in out


def test_dry_run_names_the_correction_and_warns_about_gspo_with_token_mean(capsys, no_model_load):
    _, out, _ = run(
        capsys, "train", "--dry-run", "algorithm.rollout_is=geometric", "algorithm.rollout_is_mode=mask",
        "algorithm.rollout_is_cap=1.001", "actor.loss_agg_mode=token-mean",
    )
    assert "engine-trainer correction: geometric ratios outside [0.999, 1.001] leave the loss\n" in out
    assert "WARNING: gspo with token-mean weighs a sequence by its length" in out
    _, out, _ = run(capsys, "train", "--dry-run", "algorithm.rollout_is=off")
    assert "engine-trainer correction: off\n" in out


def test_dry_run_imports_each_reward_and_checks_what_it_reads(capsys, tmp_path, no_model_load):
    """A reward file or function that is not there, or a signature nothing can fill (TRL's
    batch-of-completions functions), is the dry run's one error line, not a run whose every
    reward call fails; a reward that reads the ground truth of data that has none is warned of."""
    rewards = tmp_path / "my_rewards.py"
    rewards.write_text(
        "def exact(response, ground_truth):\n    return float(response == ground_truth)\n"
        "def loose(response, **kwargs):\n    return 1.0\n"
        "def reward_len(completions, **kwargs):\n    return [float(len(c)) for c in completions]\n"
        "def odd(response, level):\n    return 1.0\n"
    )
    no_truth = write_jsonl(tmp_path / "no_truth.jsonl", [{"question": "q"}])

    def components(*specs):
        items = ", ".join(f"{{name: r{i}, function: '{spec}'}}" for i, spec in enumerate(specs))
        return f"reward.components=[{items}]"

    code, out, _ = run(
        capsys, "train", "--dry-run", components(f"{rewards}:exact", f"{rewards}:loose", "soft_format"),
        f"data.train_files=[{no_truth}]", "reward.val_metric=r0",
    )
    assert code == 0, out
    assert f"reward r0: {rewards}:exact reads ground_truth (answer), response\n" in out  # plain layout
    assert f"reward r1: {rewards}:loose reads everything (**kwargs)\n" in out
    assert "reward r2: soft_format reads everything (**kwargs)\n" in out
    assert f"WARNING: reward r0 reads the ground truth, which {no_truth} lacks" in out
    assert "WARNING: reward r1" not in out and "WARNING: reward r2" not in out  # named only
    gone = tmp_path / "gone.py"
    assert one_line_error(capsys, "train", "--dry-run", components(f"{gone}:exact"), "reward.val_metric=r0") == (
        f"reward file not found: {gone} (from '{gone}:exact')"
    )
    assert one_line_error(capsys, "train", "--dry-run", components(f"{rewards}:exactly"), "reward.val_metric=r0") == (
        f"reward file {rewards} has no function 'exactly' (callables there: exact, loose, odd, reward_len)"
    )
    assert one_line_error(capsys, "train", "--dry-run", components(f"{rewards}:odd"), "reward.val_metric=r0") == (
        "reward component 'r0': required argument level is not one of response, ground_truth, prompt, "
        "extra_info, sample, trajectory nor set in its kwargs"
    )
    # TRL's batch signature is taken as written (tests/rewards/test_reward_trl.py)
    code, out, _ = run(capsys, "train", "--dry-run", components(f"{rewards}:reward_len"), "reward.val_metric=r0")
    assert code == 0 and "every data column (TRL's batch call)" in out


def test_explain_lists_settings(capsys, no_model_load):
    code, out, _ = run(capsys, "train", "--explain")
    assert code == 0
    assert "actor.optim.lr = 1e-06  # Peak learning rate. (verl: actor_rollout_ref.actor.optim.lr; TRL: learning_rate)" in out
    assert "rollout.n_agent = 8  # Samples per prompt" in out
    assert "reward.components[].function = ''" in out


# ------------------------------------------------------------------------- config mistakes
def test_unknown_key(capsys, no_model_load):
    message = one_line_error(capsys, "train", "actor.optim.learning_rate=1e-5")
    assert message.startswith("unknown config key 'actor.optim.learning_rate'; allowed in actor.optim: lr,")


def test_unknown_key_in_dry_run_too(capsys, no_model_load):
    assert "unknown config key 'trainr'" in one_line_error(capsys, "train", "--dry-run", "trainr.seed=1")


def test_missing_config_file(capsys, tmp_path, no_model_load):
    assert one_line_error(capsys, "train", str(tmp_path / "recipe.yaml"), "trainer.seed=1") == (
        f"config file not found: {tmp_path / 'recipe.yaml'}"
    )


def test_bad_value(capsys, no_model_load):
    message = one_line_error(capsys, "train", "--dry-run", "data.train_batch_size=4", "actor.mini_batch_size=3")
    assert "must divide data.train_batch_size (4)" in message


# ------------------------------------------------------------------------- data and model mistakes
def test_missing_dataset_fails_before_any_model_or_run_folder(capsys, tmp_path, no_model_load, caplog):
    caplog.set_level(logging.INFO)
    out_dir = tmp_path / "runs"
    message = one_line_error(
        capsys, "train", "data.train_files=[/nonexistent.jsonl]", f"trainer.output_dir={out_dir}"
    )
    assert message == "dataset file not found: /nonexistent.jsonl"
    assert not out_dir.exists()
    assert [r.getMessage() for r in caplog.records if r.name.startswith("grouprl")] == []  # nothing else said


def test_dataset_without_the_needed_columns(capsys, tmp_path, no_model_load):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt_text": "hi", "label": 1}])
    message = one_line_error(capsys, "train", f"data.train_files=[{data}]", f"trainer.output_dir={tmp_path}/runs")
    assert message.startswith(f"{data} has columns prompt_text, label; expected the verl layout")
    assert "plain layout (question, optional answer" in message


def test_empty_dataset(capsys, tmp_path, no_model_load):
    data = tmp_path / "empty.jsonl"
    data.write_text("")
    assert one_line_error(capsys, "train", f"data.train_files=[{data}]") == f"dataset {data} is empty"


def test_missing_val_dataset(capsys, tmp_path, no_model_load):
    data = write_jsonl(tmp_path / "d.jsonl", ROWS)
    message = one_line_error(capsys, "train", f"data.train_files=[{data}]", f"data.val_files=[{tmp_path}/v.parquet]")
    assert message == f"dataset file not found: {tmp_path}/v.parquet"


def test_bad_reward_file_fails_before_any_model(capsys, tmp_path, no_model_load):
    data = write_jsonl(tmp_path / "d.jsonl", ROWS)
    message = one_line_error(
        capsys, "train", f"data.train_files=[{data}]",
        f"reward.components=[{{name: r, function: '{tmp_path}/r.py:score'}}]", "reward.val_metric=r",
    )
    assert message.startswith("reward file not found:")


def test_model_path_that_does_not_exist(capsys, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", ROWS)
    out_dir = tmp_path / "runs"
    message = one_line_error(
        capsys, "train", f"data.train_files=[{data}]", f"model.path={tmp_path}/no-such-model",
        f"trainer.output_dir={out_dir}",
    )
    assert message == f"model.path '{tmp_path}/no-such-model' does not exist (not a local folder, and not a hub id)"
    assert not out_dir.exists()


@pytest.mark.parametrize("path", ["runs/sft/model", "./model", "../model", "model dir"])
def test_a_relative_model_path_that_does_not_exist_is_not_called_a_repo_id(capsys, tmp_path, monkeypatch, path):
    """More than one `/`, a leading `.`, a space: no hub id has that form, so it was meant as a folder."""
    monkeypatch.chdir(tmp_path)
    data = write_jsonl(tmp_path / "d.jsonl", ROWS)
    message = one_line_error(capsys, "train", f"data.train_files=[{data}]", f"model.path={path}", "trainer.device=cpu")
    assert message == f"model.path '{path}' does not exist (not a local folder in {tmp_path}, and not a hub id)"


def test_unknown_builtin_model(capsys, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", ROWS)
    message = one_line_error(capsys, "train", f"data.train_files=[{data}]", "model.path=builtin:gpt-17")
    assert message == "unknown built-in model 'builtin:gpt-17'; available: smollm2-135m-instruct, smolvlm-smollm2-135m"


def test_the_vllm_engine_without_vllm_is_one_line(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # as where vLLM is not installed: import fails
    model_dir = tmp_path / "model"
    tiny_model_and_tokenizer(model_dir)
    data = write_jsonl(tmp_path / "d.jsonl", ROWS)
    capsys.readouterr()  # what writing the model printed (a progress bar) is not the command's
    message = one_line_error(
        capsys, "train", f"data.train_files=[{data}]", f"model.path={model_dir}", "rollout.engine=vllm",
        f"trainer.output_dir={tmp_path}/runs",
    )
    assert message.startswith("rollout.engine=vllm needs vLLM: pip install 'grouprl[vllm]' on a CUDA machine")


@pytest.mark.slow
def test_real_process_prints_exactly_one_line(tmp_path):
    """The installed entry point, with real logging set-up: stderr is the error line alone."""
    result = subprocess.run(
        [sys.executable, "-m", "grouprl", "train", "data.train_files=[/nonexistent.jsonl]",
         f"trainer.output_dir={tmp_path}/runs"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr == "grouprl: error: dataset file not found: /nonexistent.jsonl\n"
    assert result.stdout == ""
    assert not (tmp_path / "runs").exists()


# ------------------------------------------------------------------------- a real (tiny) run
def test_train_and_eval_a_tiny_model(capsys, tmp_path):
    model_dir = tmp_path / "model"
    tiny_model_and_tokenizer(model_dir, init_std=0.02)
    data = write_jsonl(tmp_path / "d.jsonl", ROWS)
    common = [
        f"data.train_files=[{data}]", f"data.val_files=[{data}]", f"model.path={model_dir}",
        "reward.components=[{name: contains_integer}]", "reward.val_metric=contains_integer",
        "rollout.max_response_length=4", "trainer.device=cpu", f"trainer.output_dir={tmp_path}/runs",
    ]
    code, out, err = run(
        capsys, "train", *common, "data.train_batch_size=2", "rollout.n_agent=2", "trainer.total_steps=2",
        "trainer.loggers=[jsonl]", "trainer.experiment_name=cli",
    )
    assert code == 0, err
    run_dir = tmp_path / "runs" / "cli"
    assert out.splitlines()[-1].startswith("eval accuracy: baseline ")
    assert out.splitlines()[-1].endswith(" after 2 steps")
    assert (run_dir / "final" / "config.json").is_file()
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 2
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_2"

    code, out, err = run(capsys, "eval", *common, f"model.path={run_dir}/final")
    assert code == 0, err
    keys = [line.split(":")[0] for line in out.splitlines()]
    assert keys[:3] == ["val/accuracy", "val/reward", "val/response_length"]
    assert "val/contains_integer" in keys


# ------------------------------------------------------------------------- what a new user saw
@pytest.mark.slow
def test_dry_run_names_the_built_in_vlm_and_an_unknown_built_in(capsys, no_model_load):
    _, out, _ = run(capsys, "train", "--dry-run", "model.path=builtin:smolvlm-smollm2-135m", "model.cache_dir=/c")
    assert (
        "policy: builtin:smolvlm-smollm2-135m [built-in VLM: SmolLM2-135M-Instruct.Q4_1.gguf (a PyPI package) as "
        "its language model, its vision tower initialised at random; assembled once into "
        "/c/models/smolvlm-smollm2-135m]"
    ) in out
    assert "?" not in out
    _, out, _ = run(capsys, "train", "--dry-run", "model.path=builtin:gpt-17")
    assert "policy: builtin:gpt-17 [WARNING: no such built-in model; available: smollm2-135m-instruct, smolvlm-smollm2-135m]" in out


def test_an_empty_value_on_the_command_line_turns_a_string_setting_off(capsys, no_model_load):
    code, out, err = run(capsys, "train", "--dry-run", "trainer.val_breakdown=")
    assert code == 0, err


def test_an_index_into_a_recipe_list_from_the_command_line(capsys, no_model_load):
    recipe = Path(__file__).parents[1] / "configs" / "math_api_judge.yaml"
    code, out, err = run(
        capsys, "train", "--dry-run", str(recipe), "reward.judges[0].backend=openai", "reward.judges.0.model=served"
    )
    assert code == 0, err
    assert "judges: tutor (openai served)" in out
    message = one_line_error(capsys, "train", "--dry-run", str(recipe), "reward.judges[1].model=m")
    assert message.startswith("config key 'reward.judges[1]': reward.judges has 1 entry;")


def test_a_mistyped_verl_key_from_the_command_line(capsys, no_model_load):
    verl = ("algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4")
    assert one_line_error(capsys, "train", "--dry-run", *verl, "actor_rollout_ref.actor.clip_ratio_lowz=3e-4") == (
        "1 verl override(s) not taken: actor_rollout_ref.actor.clip_ratio_lowz=3e-4 (did you mean "
        "actor_rollout_ref.actor.clip_ratio_low (actor.clip_low)?)"
    )
    # with a config file: the same translator, the same line
    assert one_line_error(capsys, "train", "--dry-run", "src/grouprl/configs/default.yaml", "actor_rollout_ref.actor.clip_ratio_lowz=3e-4") == (
        "1 verl override(s) not taken: actor_rollout_ref.actor.clip_ratio_lowz=3e-4 (did you mean "
        "actor_rollout_ref.actor.clip_ratio_low (actor.clip_low)?)"
    )


def test_transformers_deprecation_warnings_are_silenced_and_others_kept(capsys, tmp_path, recwarn):
    """peft reads transformers' deprecated `is_gradient_checkpointing` of every LoRA model: the
    CLI's logging set-up silences transformers' own deprecation notices, and only those."""
    model_dir = tmp_path / "model"
    tiny_model_and_tokenizer(model_dir)
    data = write_jsonl(tmp_path / "d.jsonl", ROWS)
    code, _, err = run(
        capsys, "train", f"data.train_files=[{data}]", f"model.path={model_dir}", "model.lora.rank=2",
        "reward.components=[{name: contains_integer}]", "reward.val_metric=contains_integer",
        "rollout.max_response_length=2", "data.train_batch_size=2", "rollout.n_agent=2", "trainer.total_steps=1",
        "trainer.val_before_train=false", "trainer.save_final=false", "trainer.save_best=false",
        "trainer.loggers=[jsonl]", "trainer.device=cpu", f"trainer.output_dir={tmp_path}/runs",
    )  # fmt: skip
    assert code == 0, err
    deprecations = (FutureWarning, DeprecationWarning)
    assert [str(w.message) for w in recwarn if issubclass(w.category, deprecations)] == []
    warnings.warn_explicit("ours", FutureWarning, "grouprl/trainer/trainer.py", 1, module="grouprl.trainer.trainer")
    warnings.warn_explicit("torch's", DeprecationWarning, "torch/nn/modules/module.py", 1, module="torch.nn.modules.module")
    assert [str(w.message) for w in recwarn if issubclass(w.category, deprecations)] == ["ours", "torch's"]
