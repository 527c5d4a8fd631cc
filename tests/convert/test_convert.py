"""`grouprl convert`: a verl launch script (variables, defaults, arrays, arithmetic, line
continuations, Hydra's + prefix) or a verl YAML in; every key reported (translated, no effect
with why, not taken with the nearest setting), verl's meaning kept (its defaults where the
script is silent, its gates, VRAG's n_agent, DAPO's overlong buffer and dynamic sampling, the
reward its default scorer would pick); the written YAML is a complete config that passes the
dry run. Also `grouprl train` with verl overrides: the same translations."""


import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from grouprl.cli import main
from grouprl.config import load_config
from grouprl.convert import arguments, convert, script_arguments
from grouprl.convert.bash_expand import plain
from grouprl.errors import ConfigError

SCRIPT = r"""#!/bin/bash
set -x
ENGINE=${1:-vllm}
export DATA_HOME=${DATA_HOME_UNSET:-"/data/gsm8k"}
max_prompt_length=$((256 * 2))
max_response_length=$((1024 * 2))
overlong_buffer_len=$((1024 * 1))
ppo_max=$(( (max_prompt_length + max_response_length) * 2 ))
EXTRA=(trainer.total_epochs=3 "trainer.project_name=my project")

python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files=${DATA_HOME}/train.parquet \
    data.max_prompt_length=${max_prompt_length} \
    data.max_response_length=${max_response_length} \
    data.filter_overlong_prompts=True \
    data.truncation='error' \
    actor_rollout_ref.model.path=Qwen/Qwen2.5-3B-Instruct \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.01 \
    actor_rollout_ref.actor.use_dynamic_bsz=True \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=${ppo_max} \
    actor_rollout_ref.actor.policy_loss.loss_mode=gspo \
    actor_rollout_ref.actor.clip_ratio_low=3e-4 \
    actor_rollout_ref.actor.clip_ratio_high=4e-4 \
    actor_rollout_ref.rollout.name=$ENGINE \
    actor_rollout_ref.rollout.n=5 \
    actor_rollout_ref.rollout.top_k=-1 \
    algorithm.kl_ctrl.kl_coef=0.5 \
    +reward_model.reward_kwargs.overlong_buffer_cfg.enable=True \
    +reward_model.reward_kwargs.overlong_buffer_cfg.len=${overlong_buffer_len} \
    +reward_model.reward_kwargs.max_resp_len=${max_response_length} \
    trainer.logger='["console","wandb"]' \
    trainer.save_freq=-1 \
    trainer.experiment_name=run-$(git rev-parse --short HEAD) \
    actor_rollout_ref.actor.optim.lr_warmup_step=10 \
    "${EXTRA[@]}" $@
"""


def test_a_scripts_arguments_are_expanded_as_bash_would():
    items = script_arguments(SCRIPT)
    assert "data.train_files=/data/gsm8k/train.parquet" in items  # ${X:-"default"}, then $X/...
    assert "data.max_prompt_length=512" in items and "data.max_response_length=2048" in items  # $((...))
    assert "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=5120" in items  # names inside $((...))
    assert "actor_rollout_ref.rollout.name=vllm" in items  # ${1:-vllm} with no argument
    assert items[-2:] == ["trainer.total_epochs=3", "trainer.project_name=my project"]  # "${ARR[@]}"
    assert "+reward_model.reward_kwargs.overlong_buffer_cfg.len=1024" in items
    assert any(plain(i).startswith("trainer.experiment_name=run-$(git rev-parse") for i in items)  # only bash knows


@pytest.fixture
def gsm8k_data(tmp_path):
    path = tmp_path / "train.parquet"
    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"q{i}"}],
             "reward_model": {"style": "rule", "ground_truth": str(i)}} for i in range(4)]  # fmt: skip
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_the_script_converts_with_every_key_reported_and_verls_meaning_kept(tmp_path, gsm8k_data, capsys):
    script = tmp_path / "run.sh"
    script.write_text(SCRIPT.replace("${DATA_HOME}/train.parquet", str(gsm8k_data)))
    out = tmp_path / "run.yaml"
    assert main(["convert", str(script), "-o", str(out)]) == 0
    report = capsys.readouterr().out
    items, _ = arguments(script)
    for item in items:  # every key the script gives is in the report
        assert item.partition("=")[0].lstrip("+") in report, item
    assert "actor_rollout_ref.actor.policy_loss.loss_mode=gspo  ->  actor.policy_loss=gspo" in report
    assert "actor_rollout_ref.model.use_remove_padding=true: grouprl's passes carry no padding" in report
    assert "algorithm.kl_ctrl.kl_coef=0.5: algorithm.use_kl_in_reward is false (verl's gate): algorithm.kl_coef=0" in report
    assert "trainer.experiment_name=run-$(git rev-parse --short HEAD): its value needs what only bash knows" in report
    assert "actor_rollout_ref.actor.optim.lr_warmup_step=10: did you mean actor_rollout_ref.actor.optim.lr_warmup_steps (actor.optim.warmup_steps)?" in report
    assert "note: reward: gsm8k (verl's default scorer for data_source openai/gsm8k)" in report

    cfg = load_config(out)  # a complete config: every setting written, and valid
    tree = yaml.safe_load(out.read_text())
    assert set(tree) >= {"data", "model", "rollout", "reward", "algorithm", "actor", "trainer", "agent", "curriculum"}
    a, r = cfg.actor, cfg.rollout
    assert (a.policy_loss, a.clip_low, a.clip_high, a.loss_agg_mode) == ("gspo", 3e-4, 4e-4, "token-mean")  # verl's agg default
    assert (a.kl_loss_coef, cfg.algorithm.kl_coef, a.micro_batch_tokens) == (0.01, 0.0, 5120)  # the gates
    assert (r.n_agent, r.temperature, r.top_k, r.engine, r.stop) == (5, 1.0, 0, "vllm", [])
    assert (cfg.trainer.total_epochs, cfg.trainer.total_steps, cfg.trainer.max_time_minutes) == (3, 0, 0.0)
    assert (cfg.trainer.save_freq, cfg.trainer.project_name) == (0, "my project")
    assert cfg.trainer.loggers == ["jsonl", "console", "wandb"]
    assert (cfg.data.prompt_overflow, cfg.data.max_prompt_length, r.max_response_length) == ("skip", 512, 2048)
    assert (a.optim.weight_decay, a.optim.warmup_ratio, a.ppo_epochs) == (0.01, 0.0, 1)  # verl's defaults
    assert [(c.name, c.function, c.weight) for c in cfg.reward.components] == [
        ("score", "gsm8k", 1.0), ("overlong", "overlong_penalty", 1.0)
    ]  # fmt: skip
    assert cfg.reward.components[1].kwargs == {"max_length": 2048, "buffer_len": 1024, "penalty_factor": 1.0}
    code = main(["train", "--dry-run", str(out), "model.path=builtin:smollm2-135m"])  # the hub is not reachable here
    assert code in (0, 1)  # 1: the memory plan of this machine refuses a 2048-token batch of 1024 prompts x 5
    assert "config is valid" in capsys.readouterr().out


def test_vrags_group_size_and_a_gate_left_closed():
    tree, report = convert([
        "actor_rollout_ref.rollout.n=1", "actor_rollout_ref.rollout.n_agent=5", "actor_rollout_ref.actor.kl_loss_coef=0.01",
        "algorithm.adv_estimator=grpo", "retriever.url=http://127.0.0.1:8000/search", "max_turns=4",
        "actor_rollout_ref.actor.kl_loss_type=clipping",  # the source's script: a KL type grouprl does not have
    ])  # fmt: skip
    assert [(k, v) for k, v, _ in report.not_taken] == [("actor_rollout_ref.actor.kl_loss_type", "clipping")]
    assert "algorithm.rollout_is" in dict(report.defaults) and tree["algorithm"]["rollout_is"] == "off"  # verl corrects nothing
    assert tree["actor"]["kl_loss_type"] == "low_var_kl"  # verl's default, the config valid
    assert tree["rollout"]["n_agent"] == 5 and tree["actor"]["kl_loss_coef"] == 0
    assert ("actor_rollout_ref.rollout.n", 1, "VRAG's group size is rollout.n_agent=5") in report.no_effect
    assert any(k == "actor_rollout_ref.actor.kl_loss_coef" and "use_kl_loss is false" in why for k, _, why in report.no_effect)
    assert tree["agent"]["retriever"]["url"] == "http://127.0.0.1:8000/search" and tree["agent"]["max_turns"] == 4
    assert tree["reward"]["components"][0]["function"] == "verl_default"  # no data to read: chosen per sample


def test_a_verl_yaml_and_dynamic_sampling(tmp_path):
    path = tmp_path / "ppo.yaml"
    path.write_text(yaml.safe_dump({
        "data": {"train_batch_size": 32, "gen_batch_size": 96},
        "algorithm": {"adv_estimator": "rloo", "filter_groups": {"enable": True}},
        "actor_rollout_ref": {"actor": {"clip_ratio": 0.28}, "rollout": {"n": 4}},
    }))  # fmt: skip
    tree, report = convert(arguments(path)[0])
    assert tree["curriculum"] == {"dynamic_filter": True, "max_oversample": 3.0} and tree["data"]["sampler"] == "curriculum"
    assert tree["actor"]["clip_low"] == tree["actor"]["clip_high"] == 0.28
    assert tree["algorithm"]["adv_estimator"] == "rloo"


@pytest.mark.parametrize(
    "items, said",
    [
        (["algorithm.adv_estimator=gae", "actor_rollout_ref.rollout.n=1"], "algorithm.adv_estimator=gae trains a critic"),
        (["actor_rollout_ref.rollout.n=4"], "no algorithm.adv_estimator (verl's default: gae) trains a critic"),
        (["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=1"], "a group of one sample has no baseline"),
        (["algorithm.adv_estimator=rloo"], "without actor_rollout_ref.rollout.n (verl's default: 1)"),
    ],
)
def test_a_critic_or_a_group_of_one_is_refused_in_one_line(items, said, capsys):
    with pytest.raises(ConfigError, match=said.replace("(", r"\(").replace(")", r"\)")) as caught:
        convert(items)
    assert "grpo, rloo or grpo_batch" in str(caught.value) or "rollout.n > 1" in str(caught.value)
    assert main(["train", "--dry-run", *items, "trainer.total_training_steps=1"]) == 2  # verl's names, no config file
    assert capsys.readouterr().err.count("\n") == 1


def test_train_takes_the_same_translations_directly(caplog):
    cfg = load_config(None, [
        "data.truncation=left", "actor_rollout_ref.rollout.top_k=-1", "actor_rollout_ref.actor.policy_loss.loss_mode=vanilla",
        "trainer.logger=['console']", "actor_rollout_ref.model.use_remove_padding=True",
        "actor_rollout_ref.rollout.val_kwargs.temperature=0.6", "actor_rollout_ref.rollout.max_model_len=4096",
    ])  # fmt: skip
    assert (cfg.data.prompt_overflow, cfg.rollout.top_k, cfg.actor.policy_loss) == ("truncate", 0, "ppo")
    assert (cfg.trainer.loggers, cfg.rollout.val_temperature, cfg.rollout.max_model_len) == (["jsonl", "console"], 0.6, 4096)
    assert "verl key 'actor_rollout_ref.model.use_remove_padding' has no effect in grouprl" in caplog.text


def test_the_docs_table_is_the_translation_table():
    from pathlib import Path

    from grouprl.convert import mapping_table

    readme = (Path(__file__).resolve().parents[2] / "docs" / "verl-trl.md").read_text()
    block = readme.split("<!-- verl-table -->\n", 1)[1].split("\n<!-- /verl-table -->", 1)[0]
    assert block.splitlines() == mapping_table()


def test_train_with_verl_overrides_alone_runs_verls_meaning_and_lists_every_key_it_cannot_take(capsys):
    verl = ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4", "trainer.total_epochs=2",
            "actor_rollout_ref.actor.use_kl_loss=True", "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2"]  # fmt: skip
    code = main(["train", "--dry-run", *verl, "model.path=builtin:smollm2-135m-instruct"])
    out = capsys.readouterr().out
    assert code in (0, 1) and "config is valid" in out
    assert "loss: ppo (clip 0.8..1.2, token-mean)" in out  # verl's, not the demo recipe's GSPO
    assert "kl_loss_coef=0.001" in out  # the gate opened with verl's default coefficient
    assert "batch: 4 prompts x 4 samples" in out
    code = main(["train", "--dry-run", *verl, "actor_rollout_ref.rollout.max_num_seq=3", "critic.x=1"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("grouprl: error: 2 verl override(s) not taken: actor_rollout_ref.rollout.max_num_seq=3 "
                          "(did you mean actor_rollout_ref.rollout.max_num_seqs?); critic.x=1 (nothing in grouprl reads it")  # fmt: skip


def test_a_gate_given_alone_is_reported():
    _, report = convert(["algorithm.use_kl_in_reward=False", "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2"])
    assert ("algorithm.use_kl_in_reward", False, "algorithm.kl_coef", 0) in report.translated


def test_a_quickstart_script_with_an_environment_prefix_and_other_commands(tmp_path):
    script = tmp_path / "run.sh"
    script.write_text(
        "source ~/venvs/vrag/bin/activate\n"
        "MODEL=Qwen/Qwen2.5-3B\n"
        "PYTHONUNBUFFERED=1 python3 -m verl.trainer.main_ppo \\\n"
        "    actor_rollout_ref.model.path=$MODEL data.train_batch_size=384 \\\n"
        "    data.truncation=left data.filter_overlong_prompts=False algorithm.adv_estimator=grpo actor_rollout_ref.rollout.n=5\n"
    )
    items, _ = arguments(script)
    assert items == ["actor_rollout_ref.model.path=Qwen/Qwen2.5-3B", "data.train_batch_size=384",
                     "data.truncation=left", "data.filter_overlong_prompts=False", "algorithm.adv_estimator=grpo",
                     "actor_rollout_ref.rollout.n=5"]  # fmt: skip
    tree, report = convert(items)
    assert tree["actor"]["mini_batch_size"] == 192  # verl's 256 does not divide 384
    assert tree["data"]["prompt_overflow"] == "truncate"  # truncation decides when filtering is off
    reversed_order, _ = convert(list(reversed(items)))
    assert reversed_order["data"]["prompt_overflow"] == "truncate"  # whatever the order


def test_gates_with_a_config_file_act_after_the_other_overrides():
    from pathlib import Path

    default = Path(__file__).resolve().parents[2] / "src" / "grouprl" / "configs" / "default.yaml"
    gate = "actor_rollout_ref.actor.use_kl_loss"
    assert load_config(default, [f"{gate}=true"]).actor.kl_loss_coef == 0.001  # verl's coefficient
    assert load_config(default, [f"{gate}=false", "actor_rollout_ref.actor.kl_loss_coef=0.01"]).actor.kl_loss_coef == 0
    assert load_config(default, [f"{gate}=true", "actor.kl_loss_coef=0.05"]).actor.kl_loss_coef == 0.05


MULTI_TURN = r"""#!/bin/bash
set -x
PROJECT_DIR="$(pwd)"
CONFIG_PATH="$PROJECT_DIR/examples/multiturn/config"
python3 -m verl.trainer.main_ppo \
    --config-path="$CONFIG_PATH" \
    --config-name='mt_grpo' \
    algorithm.adv_estimator=grpo \
    data.train_batch_size=64 \
    actor_rollout_ref.rollout.n=4 \
    actor_rollout_ref.actor.freeze_vision_tower=True \
    algorithm.rollout_correction.rollout_is=null \
    actor_rollout_ref.rollout.multi_turn.tool_config_path="$PROJECT_DIR/examples/multiturn/config/tool.yaml"
"""


def write_hydra_files(root):
    config = root / "examples" / "multiturn" / "config"
    config.mkdir(parents=True)
    (config / "base.yaml").write_text("data:\n  max_prompt_length: 300\n  train_batch_size: 8\n")
    (config / "mt_grpo.yaml").write_text(
        "hydra:\n  searchpath:\n    - file://verl/trainer/config\n"
        "defaults:\n  - ppo_trainer\n  - base\n  - _self_\n"
        "data:\n  max_response_length: 700\n  train_batch_size: 256\n"
        "actor_rollout_ref:\n  rollout:\n    name: sglang\n    multi_turn:\n      enable: True\n      max_assistant_turns: 5\n"
        "  actor:\n    optim:\n      lr: ${actor_rollout_ref.actor.optim.lr_base}\n      lr_base: 3.0e-6\n"
    )
    script = root / "examples" / "multiturn" / "run_mt.sh"
    script.write_text(MULTI_TURN)
    return script


def test_a_hydra_file_is_read_onto_verls_defaults_and_the_command_line_wins(tmp_path, monkeypatch, capsys):
    script = write_hydra_files(tmp_path)
    monkeypatch.chdir(tmp_path)  # where verl's scripts run from: the repository's root
    out = tmp_path / "run.yaml"
    assert main(["convert", str(script), "-o", str(out)]) == 0
    report = capsys.readouterr().out
    cfg = load_config(out)
    assert cfg.agent.enabled and cfg.agent.max_turns == 5  # the file's multi-turn settings
    assert cfg.data.max_prompt_length == 300 and cfg.rollout.max_response_length == 700  # base.yaml, then the file
    assert cfg.data.train_batch_size == 64  # the command line wins over both
    assert cfg.actor.optim.lr == 3e-6  # ${...} of another key
    assert cfg.rollout.engine == "vllm" and "vllm in place of sglang" in report
    assert "--config-name=mt_grpo: 8 settings read from" in report
    assert "actor_rollout_ref.actor.optim.lr_base=3.0e-06: nothing in grouprl reads it" in report
    # verl's meaning: the tower trains unless frozen with verl's key; no correction when rollout_is is null
    assert cfg.model.freeze_vision_tower is True and cfg.algorithm.rollout_is == "off"
    assert "algorithm.rollout_correction.rollout_is=null  ->  algorithm.rollout_is='off'" in report
    monkeypatch.chdir(tmp_path / "examples")  # elsewhere: found above the script all the same
    assert main(["convert", str(script), "-o", str(out)]) == 0
    monkeypatch.chdir("/")
    (tmp_path / "examples" / "multiturn" / "config" / "mt_grpo.yaml").unlink()
    assert main(["convert", str(script), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Hydra file mt_grpo.yaml is not found" in err


def test_verls_defaults_for_a_vlm_and_the_correction():
    tree, report = convert(["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=5", "actor_rollout_ref.rollout.name=vllm"])
    assert tree["model"]["freeze_vision_tower"] is False  # verl trains the vision tower
    assert tree["algorithm"]["rollout_is"] == "off"
    assert any("grouprl suggests algorithm.rollout_is=auto" in n and "not applied" in n for n in report.notes)
    tree, _ = convert(["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=5", "algorithm.rollout_correction.rollout_is=token"])
    assert tree["algorithm"]["rollout_is"] == "token"


@pytest.mark.parametrize(
    "text, said",
    [
        ("#!/bin/bash\necho preparing\npip install verl\n", "no call of verl's trainer"),
        ("#!/bin/bash\nif [ \"$(uname)\" = Darwin ]; then\n  python3 -m verl.trainer.main_ppo a=1\nfi\n",
         "the trainer call at line 3 is never reached"),
        ("#!/bin/bash\npython3 -m verl.trainer.main_ppo a='never closed\n", "single quote is never closed"),
    ],
)
def test_a_script_without_a_trainer_call_is_an_error(tmp_path, capsys, text, said):
    script = tmp_path / "run.sh"
    script.write_text(text)
    assert main(["convert", str(script), "-o", str(tmp_path / "out.yaml")]) == 2
    err = capsys.readouterr().err
    assert said in err and err.count("\n") == 1 and not (tmp_path / "out.yaml").exists()


def test_unreadable_inputs_are_one_line(tmp_path, capsys):
    script = tmp_path / "run.sh"
    script.write_bytes(b"#!/bin/bash\nX=\xff\xfe\npython3 -m verl.trainer.main_ppo a=$X\n")
    assert main(["convert", str(script), "-o", str(tmp_path / "o.yaml")]) == 2
    assert "is not UTF-8 text (byte 14)" in capsys.readouterr().err
    data = tmp_path / "train.parquet"
    data.write_bytes(b"PAR1 not really parquet")
    script.write_text(f"python3 -m verl.trainer.main_ppo algorithm.adv_estimator=grpo actor_rollout_ref.rollout.n=2 data.train_files={data}\n")
    assert main(["convert", str(script), "-o", str(tmp_path / "o.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"grouprl: error: data file {data} cannot be read") and err.count("\n") == 1
    lines = tmp_path / "train.jsonl"
    lines.write_text('{"data_source": "openai/gsm8k"}\n{"data_source": \n')
    script.write_text(script.read_text().replace(str(data), str(lines)))
    assert main(["convert", str(script), "-o", str(tmp_path / "o.yaml")]) == 2
    assert "line 2 is not JSON" in capsys.readouterr().err


def test_secrets_stay_references_and_shell_syntax_is_not_translated(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MY_SECRET_TOKEN", "hunter2-value")
    script = tmp_path / "run.sh"
    script.write_text(
        "python3 -m verl.trainer.main_ppo algorithm.adv_estimator=grpo actor_rollout_ref.rollout.n=2 "
        "trainer.experiment_name=${MY_SECRET_TOKEN} actor_rollout_ref.model.path=`touch pwned` "
        "trainer.project_name=<(cat x) data.train_batch_size=8\n"
    )
    out = tmp_path / "run.yaml"
    assert main(["convert", str(script), "-o", str(out)]) == 0
    report = capsys.readouterr().out
    assert "hunter2" not in report and "hunter2" not in out.read_text()
    assert "trainer.experiment_name=${MY_SECRET_TOKEN}: holds a secret's reference, never written out" in report
    assert "${MY_SECRET_TOKEN} is a secret's name: kept as the reference" in report
    for key in ("actor_rollout_ref.model.path=$(touch pwned)", "trainer.project_name=<(cat x)"):
        assert f"{key}: its value needs what only bash knows" in report
    assert not (tmp_path / "pwned").exists() and not (tmp_path.parent / "pwned").exists()


def test_hints_name_only_close_keys_that_exist_and_errors_name_keys():
    from grouprl.config.translate import hint
    from grouprl.convert import mapping_table

    assert hint("actor_rollout_ref.actor.optim.clip_grad").startswith("nothing in grouprl reads it")
    assert hint("trainer.val_only").startswith("nothing in grouprl reads it")  # not trainer.val_before_train
    assert hint("actor_rollout_ref.rollout.over_sample_rate").startswith("nothing in grouprl reads it")
    assert hint("actor_rollout_ref.actor.clip_ratio_lowz") == "did you mean actor_rollout_ref.actor.clip_ratio_low (actor.clip_low)?"
    assert hint("actor_rollout_ref.actor.loss_mode_agg") == "did you mean actor_rollout_ref.actor.loss_agg_mode (actor.loss_agg_mode)?"
    assert not any("no effect: no effect" in row for row in mapping_table())
    with pytest.raises(ConfigError) as caught:
        load_config(None, ["model.path=x", "reward_model.made_up=1"])
    assert "grouprl.config" not in str(caught.value) and "reward_model.made_up" in str(caught.value)


def test_a_gate_whose_value_only_bash_knows_decides_nothing(tmp_path):
    script = tmp_path / "run.sh"
    script.write_text(
        "max_len=$(((prompt + response) / sp_size))  # sp_size is set later: bash divides by zero here\n"
        "sp_size=4\n"
        "python3 -m verl.trainer.main_ppo algorithm.adv_estimator=grpo actor_rollout_ref.rollout.n=2 "
        "actor_rollout_ref.actor.use_dynamic_bsz=True actor_rollout_ref.actor.ppo_max_token_len_per_gpu=$max_len\n"
    )
    items, notes = arguments(script)
    assert any("division by zero (kept as written)" in n for n in notes)
    tree, report = convert(items)
    assert ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", "$(((prompt + response) / sp_size))") in [
        (k, v) for k, v, _ in report.not_taken
    ]
    assert tree["actor"]["micro_batch_tokens"] == 0  # verl's default: nothing unknown written


def test_the_plans_accumulation_count_is_each_ranks(capsys):
    common = ["data.train_batch_size=64", "rollout.n_agent=8", "actor.mini_batch_size=32", "actor.micro_batch_size=4",
              "actor.micro_batch_tokens=0", "model.path=builtin:smollm2-135m-instruct"]  # fmt: skip
    main(["train", *common, "--dry-run"])
    assert "micro-batches: 4 samples -> 64 accumulation step(s) per mini-batch" in capsys.readouterr().out  # 256 samples, one rank
    main(["train", *common, "trainer.n_gpus_per_node=8", "trainer.gpu_memory_gb=80", "--dry-run"])
    out = capsys.readouterr().out
    assert "micro-batches: 4 samples -> 8 accumulation step(s) per mini-batch on each of the 8 ranks (32 samples each)" in out
