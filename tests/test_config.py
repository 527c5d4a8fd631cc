"""The config tree: defaults, YAML + dotted overrides, one-line errors, cross-field checks,
verl names, and `explain` documenting every setting."""

import dataclasses
import typing

import pytest

from grouprl.cli import DEFAULT_RECIPE
from grouprl.config import (
    VERL_KEYS,
    Config,
    RewardComponentConfig,
    explain,
    field_docs,
    from_dict,
    load_config,
    to_dict,
    validate,
)
from grouprl.errors import ConfigError, UserError


def dataclasses_in_tree(cls=Config, seen=None):
    """Every dataclass reachable from `cls`: sections and the items of lists of dataclasses."""
    seen = [] if seen is None else seen
    if cls in seen:
        return seen
    seen.append(cls)
    for tp in typing.get_type_hints(cls).values():
        if typing.get_origin(tp) is list:
            tp = typing.get_args(tp)[0]
        if dataclasses.is_dataclass(tp):
            dataclasses_in_tree(tp, seen)
    return seen


def config_error(overrides=(), path=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    message = str(info.value)
    assert "\n" not in message  # one line
    return message


def write(tmp_path, text, name="c.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


# ------------------------------------------------------------------------- defaults
def test_every_default_loads_and_validates():
    cfg = load_config()
    assert cfg == Config()
    assert validate(Config()) == Config()
    for cls in dataclasses_in_tree():
        cls()  # every section (and list item) has a default for every field
    assert RewardComponentConfig in dataclasses_in_tree()


def test_the_default_recipe_loads_with_its_values():
    cfg = load_config(DEFAULT_RECIPE)
    assert cfg.model.path == "builtin:smollm2-135m-instruct"
    assert (cfg.data.train_batch_size, cfg.rollout.n_agent) == (4, 8)
    assert cfg.rollout.stop == ["</answer>"]
    assert cfg.actor.policy_loss == "gspo"
    assert cfg.actor.clip_low == pytest.approx(3e-4) and cfg.actor.clip_high == pytest.approx(4e-4)
    assert cfg.actor.optim.lr == pytest.approx(1e-5) and isinstance(cfg.actor.optim.lr, float)
    assert [(c.name, c.weight) for c in cfg.reward.components] == [("correctness", 1.0), ("soft_format", 0.1)]
    assert cfg.trainer.total_steps == 20 and cfg.trainer.test_freq == 10 and cfg.rollout.temperature == pytest.approx(0.7)


def test_to_dict_round_trips_through_load(tmp_path):
    import yaml

    cfg = load_config(DEFAULT_RECIPE, ["model.lora.rank=4", "actor.dual_clip=null"])
    again = load_config(write(tmp_path, yaml.safe_dump(to_dict(cfg))))
    assert again == cfg
    assert from_dict(to_dict(cfg)) == cfg  # as a Ray worker gets it


def test_the_ray_launcher_settings():
    cfg = load_config(None, ["trainer.launcher=ray", "trainer.ray_workers=8", "trainer.ray_cpus_per_worker=4"])
    assert (cfg.trainer.launcher, cfg.trainer.ray_workers, cfg.trainer.ray_cpus_per_worker) == ("ray", 8, 4)
    assert load_config().trainer.launcher == "local"
    assert load_config(None, ["trainer.device=cuda:1"]).trainer.device == "cuda:1"  # one process picks its GPU


# ------------------------------------------------------------------------- YAML + overrides
def test_yaml_then_overrides_with_every_value_kind(tmp_path):
    path = write(
        tmp_path,
        "data:\n  train_batch_size: 8\n  train_files: [a.jsonl]\n"
        "actor:\n  optim:\n    lr: 1e-6\n    betas: [0.8, 0.9]\n"
        "trainer:\n  total_steps: 5\n",
    )
    cfg = load_config(
        path,
        [
            "data.train_batch_size=16",  # override wins over the file
            "actor.optim.weight_decay=1e-2",  # YAML reads 1e-2 (no dot) as a string
            "actor.clip_low=2e-1",
            "actor.optim.warmup_steps=3",
            "data.val_files=[v1.jsonl, v2.parquet]",
            "actor.dual_clip=null",
            "data.system_prompt=null",
            'rollout.stop=["</answer>", "\\n\\n"]',  # YAML double quotes read escapes
            "trainer.val_before_train=false",
            "rollout.temperature=1",  # int into a float field
        ],
    )
    assert cfg.data.train_batch_size == 16
    assert cfg.data.train_files == ["a.jsonl"]
    assert cfg.actor.optim.lr == 1e-6 and type(cfg.actor.optim.lr) is float
    assert cfg.actor.optim.betas == [0.8, 0.9]
    assert cfg.actor.optim.weight_decay == 1e-2 and type(cfg.actor.optim.weight_decay) is float
    assert cfg.actor.clip_low == 0.2
    assert cfg.actor.optim.warmup_steps == 3
    assert cfg.data.val_files == ["v1.jsonl", "v2.parquet"]
    assert cfg.actor.dual_clip is None and cfg.data.system_prompt is None
    assert cfg.rollout.stop == ["</answer>", "\n\n"]
    assert cfg.trainer.val_before_train is False
    assert cfg.rollout.temperature == 1.0 and type(cfg.rollout.temperature) is float
    assert cfg.trainer.total_steps == 5  # untouched file value stays


def test_lists_of_sections_and_single_string_for_a_list(tmp_path):
    path = write(
        tmp_path,
        "reward:\n  components:\n    - {name: a, function: /x/r.py:fn, weight: 2, kwargs: {k: 1}}\n"
        "    - name: soft_format\n  val_metric: a\n",
    )
    cfg = load_config(path, ["data.train_files=one.jsonl"])
    assert cfg.reward.components == [
        RewardComponentConfig(name="a", function="/x/r.py:fn", weight=2.0, kwargs={"k": 1}),
        RewardComponentConfig(name="soft_format"),
    ]
    assert cfg.data.train_files == ["one.jsonl"]
    over = load_config(None, ["reward.components=[{name: b, weight: 0.5}]", "reward.val_metric=reward"])
    assert over.reward.components == [RewardComponentConfig(name="b", weight=0.5)]


def test_empty_file_and_empty_section_mean_defaults(tmp_path):
    assert load_config(write(tmp_path, "")) == Config()
    assert load_config(write(tmp_path, "actor:\n  # lr: 1e-5\ntrainer:\n  seed: 3\n", "b.yaml")).trainer.seed == 3


# ------------------------------------------------------------------------- errors: unknown keys
@pytest.mark.parametrize(
    "where, key, allowed",
    [
        ("yaml", "modle", "data, model, rollout, agent, reward, algorithm, actor, trainer, curriculum, sft"),
        ("yaml", "actor.optim.learning_rate", "lr, weight_decay, betas"),
        ("override", "trainer.total_step", "total_steps, total_epochs"),
        ("override", "actor.optim.lr_warmup", "warmup_steps, warmup_ratio"),
    ],
)
def test_unknown_key_names_the_key_and_what_is_allowed(tmp_path, where, key, allowed):
    if where == "yaml":
        parts = key.split(".")
        text = "".join("  " * i + p + ":\n" for i, p in enumerate(parts[:-1])) + "  " * (len(parts) - 1) + f"{parts[-1]}: 1\n"
        message = config_error(path=write(tmp_path, text))
    else:
        message = config_error([f"{key}=1"])
    assert f"unknown config key '{key}'" in message
    assert allowed in message
    section = key.rpartition(".")[0] or "the top level"
    assert f"allowed in {section}:" in message


def test_unknown_key_inside_a_list_item():
    message = config_error(["reward.components=[{name: a, wieght: 2}]"])
    assert "'reward.components[0].wieght'" in message and "name, function, weight, kwargs" in message


# ------------------------------------------------------------------------- errors: values
@pytest.mark.parametrize(
    "override, expected",
    [
        ("data.train_batch_size=abc", "config key 'data.train_batch_size' must be an integer, got 'abc'"),
        ("data.train_batch_size=2.5", "must be an integer"),
        ("trainer.total_steps=true", "must be an integer"),
        ("actor.optim.lr=fast", "config key 'actor.optim.lr' must be a number, got 'fast'"),
        ("trainer.save_final=maybe", "config key 'trainer.save_final' must be true or false"),
        ("data.train_files={a: 1}", "config key 'data.train_files' must be a list of str"),
        ("actor.optim.betas=[0.9, x]", "config key 'actor.optim.betas[1]' must be a number"),
        ("data=5", "config key 'data' must be a mapping of settings"),
        ("data.sampler=shuffle", "config key 'data.sampler' must be one of 'random', 'sequential', 'curriculum', got 'shuffle'"),
        ("model.dtype=fp8", "config key 'model.dtype' must be one of 'auto', 'float32', 'bfloat16', 'float16'"),
        ("trainer.resume_mode=yes", "config key 'trainer.resume_mode' must be one of 'auto', 'disable', 'path'"),
        ("trainer.launcher=slurm", "config key 'trainer.launcher' must be one of 'local', 'ray', got 'slurm'"),
        ("nodots", "override 'nodots' must look like section.key=value"),
    ],
)
def test_wrong_types_and_literals(override, expected):
    assert expected in config_error([override])


def test_malformed_yaml_names_the_line(tmp_path):
    path = write(tmp_path, "data:\n  train_batch_size: 4\n  task: [unclosed\nmodel:\n  path: x\n")
    message = config_error(path=path)
    assert message.startswith(f"malformed YAML in {path} (line ")
    line = int(message.split("(line ")[1].split(",")[0])
    assert 3 <= line <= 4  # where the flow sequence opened / where the parser gave up


@pytest.mark.parametrize("text, kind", [("- a\n- b\n", "list"), ("just text\n", "str"), ("3\n", "int")])
def test_yaml_that_is_not_a_mapping(tmp_path, text, kind):
    assert f"must hold a mapping of sections, got {kind}" in config_error(path=write(tmp_path, text))


def test_missing_config_file(tmp_path):
    assert config_error(path=tmp_path / "nope.yaml") == f"config file not found: {tmp_path / 'nope.yaml'}"


# ------------------------------------------------------------------------- impossible combinations
@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["data.train_batch_size=4", "actor.mini_batch_size=3"], "'actor.mini_batch_size' (3) must divide data.train_batch_size (4)"),
        (["data.train_batch_size=4", "actor.mini_batch_size=8"], "must divide data.train_batch_size (4)"),
        (["actor.mini_batch_size=-1"], "'actor.mini_batch_size' must be >= 0, got -1"),
        (["actor.optim.warmup_steps=-2"], "'actor.optim.warmup_steps' must be >= 0"),
        (["trainer.save_freq=-1"], "'trainer.save_freq' must be >= 0"),
        (["model.quantization=4bit"], "'model.quantization' needs model.lora.rank > 0"),
        (["model.quantization=4bit", "model.lora.rank=8", "rollout.engine=vllm"], "'model.quantization=4bit' cannot feed rollout.engine=vllm"),
        (["trainer.nnodes=0"], "'trainer.nnodes' must be >= 1"),
        (["trainer.gpu_memory_gb=-1"], "'trainer.gpu_memory_gb' must be >= 0"),
        (["trainer.memory_check=maybe"], "'trainer.memory_check' must be one of 'refuse', 'warn', 'off'"),
        (["trainer.resume_mode=path"], "'trainer.resume_from_path' must be set when trainer.resume_mode is 'path'"),
        (["algorithm.adv_estimator=gae"], "'algorithm.adv_estimator' must be one of grpo, grpo_batch, rloo, got 'gae'"),
        (["actor.policy_loss=grpo"], "'actor.policy_loss' must be one of cispo, geo_mean, gmpo, gspo, ppo, sapo, vanilla, got 'grpo'"),
        (
            ["actor.loss_agg_mode=sum"],
            "'actor.loss_agg_mode' must be one of seq-mean-token-mean, seq-mean-token-sum, "
            "seq-mean-token-sum-norm, token-mean, got 'sum'",
        ),
        (["actor.kl_loss_type=k9"], "'actor.kl_loss_type' must be one of "),
        (["trainer.loggers=[jsonl, mlflow]"], "'trainer.loggers' must be one of console, jsonl, tensorboard, wandb"),
        (["actor.dual_clip=0.5"], "'actor.dual_clip' must be > 1.0 or null"),
        (["rollout.top_p=0"], "'rollout.top_p' must be in (0, 1]"),
        (["reward.components=[{name: a}, {name: a}]", "reward.val_metric=a"], "duplicate names"),
        (["reward.components=[{name: a}]"], "'reward.val_metric' must be 'reward' or a component name (a)"),
        (["reward.components=[]"], "must name at least one reward"),
        (["trainer.total_steps=0", "trainer.total_epochs=0"], "'trainer.total_epochs' must be >= 1"),
        (["algorithm.rollout_is=tokens"], "'algorithm.rollout_is' must be one of"),
        (["rollout.engine=vllm", "algorithm.rollout_is_cap=0"], "'algorithm.rollout_is_cap' must be > 0"),
        (["algorithm.rollout_is_lower=3"], "'algorithm.rollout_is_lower' must be in [0, algorithm.rollout_is_cap)"),
        (
            ["algorithm.rollout_is_mode=mask", "algorithm.rollout_is_cap=0.9"],
            "'algorithm.rollout_is_cap' must be > 1 and 'algorithm.rollout_is_lower' < 1 with rollout_is_mode=mask",
        ),
        (["actor.loss_scale_factor=-1"], "'actor.loss_scale_factor' must be >= 0"),
        (
            ["rollout.engine=vllm", "rollout.tensor_parallel_size=2"],
            "'rollout.tensor_parallel_size' must be 1: every rank runs its own vllm engine in its process, holding the whole model on its GPU",
        ),
        (["rollout.engine=vllm", "rollout.sleep_level=3"], "'rollout.sleep_level' must be 0, 1 or 2"),
        (["rollout.gpu_memory_utilization=1.5"], "'rollout.gpu_memory_utilization' must be in (0, 1]"),
        (["rollout.engine=sglang"], "'rollout.engine' must be one of 'auto', 'hf', 'vllm'"),
        (["trainer.ray_workers=-1"], "'trainer.ray_workers' must be >= 0 (0 = one per GPU of the cluster)"),
        (["trainer.ray_cpus_per_worker=0"], "'trainer.ray_cpus_per_worker' must be >= 1"),
        (
            ["trainer.launcher=ray", "trainer.device=cuda:1"],
            "config key 'trainer.device' must be auto, cpu or cuda with trainer.launcher=ray (Ray gives each "
            "worker its GPU), got 'cuda:1'",
        ),
    ],
)
def test_validate_rejects_impossible_combinations(overrides, expected):
    assert expected in config_error(overrides)


def test_errors_are_user_errors():
    assert issubclass(ConfigError, UserError)


# ------------------------------------------------------------------------- verl names
def test_verl_keys_translate():
    cfg = load_config(
        None,
        [
            "actor_rollout_ref.actor.clip_ratio_low=0.2",
            "actor_rollout_ref.actor.clip_ratio_high=0.28",
            "+actor_rollout_ref.rollout.n_agent=5",  # hydra's "+" prefix
            "actor_rollout_ref.actor.optim.lr=1e-6",
            "algorithm.kl_ctrl.kl_coef=0.001",
            "algorithm.use_kl_in_reward=True",  # verl's gate: without it kl_coef has no effect (as in verl)
            "data.max_response_length=64",
            "trainer.total_training_steps=7",
            "actor_rollout_ref.model.lora_rank=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        ],
    )
    assert (cfg.actor.clip_low, cfg.actor.clip_high) == (0.2, 0.28)
    assert cfg.rollout.n_agent == 5
    assert cfg.actor.optim.lr == 1e-6
    assert cfg.algorithm.kl_coef == 0.001
    assert cfg.rollout.max_response_length == 64
    assert cfg.trainer.total_steps == 7
    assert cfg.model.lora.rank == 8
    assert cfg.actor.mini_batch_size == 2


@pytest.mark.parametrize("value, sampler", [("false", "sequential"), ("False", "sequential"), ("true", "random")])
def test_verl_shuffle_becomes_the_sampler(value, sampler):
    assert load_config(None, [f"data.shuffle={value}"]).data.sampler == sampler


def test_every_verl_target_is_a_real_key():
    names = {line.split(" = ")[0] for line in explain() if " = " in line}
    for verl, ours in VERL_KEYS.items():
        assert ours in names, f"{verl} maps to unknown key {ours}"


# ------------------------------------------------------------------------- explain / docs
def test_every_field_has_a_docstring():
    undocumented = [
        f"{cls.__name__}.{f.name}"
        for cls in dataclasses_in_tree()
        for f in dataclasses.fields(cls)
        if not field_docs(cls).get(f.name)
    ]
    assert undocumented == []


def test_explain_lists_every_setting_with_its_doc():
    lines = explain()
    settings = {}
    for line in lines:
        if line.startswith("# "):
            assert line.split(": ", 1)[1].strip(), line  # sections documented too
            continue
        key_default, _, doc = line.partition("  # ")
        assert doc.strip(), f"no doc for {line!r}"
        settings[key_default.split(" = ")[0]] = doc

    def keys(cls, prefix=""):
        for f in dataclasses.fields(cls):
            tp = typing.get_type_hints(cls)[f.name]
            if dataclasses.is_dataclass(tp):
                yield from keys(tp, f"{prefix}{f.name}.")
                continue
            yield prefix + f.name
            if typing.get_origin(tp) is list and dataclasses.is_dataclass(typing.get_args(tp)[0]):
                yield from keys(typing.get_args(tp)[0], f"{prefix}{f.name}[].")

    expected = list(keys(Config))
    assert sorted(settings) == sorted(expected)
    assert "reward.components[].function" in settings and "actor.optim.lr" in settings
    assert "actor.optim.lr = 1e-06  # Peak learning rate" in "\n".join(lines)


def test_a_bare_off_means_the_setting_off_not_false():
    """YAML reads `off` as false; a setting whose choices include "off" takes it as "off"."""
    assert load_config(None, ["algorithm.rollout_is=off"]).algorithm.rollout_is == "off"


# ------------------------------------------------------------------------- list entries by index
RECIPES = __import__("pathlib").Path(__file__).parents[1] / "configs"


@pytest.mark.parametrize("spelling", ["reward.judges[0].{}", "reward.judges.0.{}"])
def test_a_list_entry_field_is_overridden_by_index_and_keeps_its_other_fields(spelling):
    """The recipe's own advice (an OpenAI-compatible server in place of Gemini), both spellings."""
    recipe = RECIPES / "math_api_judge.yaml"
    cfg = load_config(
        recipe,
        [spelling.format("backend=openai"), spelling.format("base_url=http://host:8000/v1"), spelling.format("model=served")],
    )
    (judge,) = cfg.reward.judges
    assert (judge.backend, judge.base_url, judge.model) == ("openai", "http://host:8000/v1", "served")
    original = load_config(recipe).reward.judges[0]
    assert judge == dataclasses.replace(original, backend="openai", base_url="http://host:8000/v1", model="served")
    assert (judge.name, judge.fields, judge.scale, judge.api_key_env) == ("tutor", {"reasoning": 1.0}, 5.0, "GEMINI_API_KEY")


def test_an_index_reaches_default_lists_reward_models_and_lists_of_values(tmp_path):
    cfg = load_config(None, ["reward.components[1].weight=0.5", "reward.components.0.kwargs.k=1", "actor.optim.betas[1]=0.99"])
    assert cfg.reward.components == [  # the default list, changed where indexed
        RewardComponentConfig(name="correctness", weight=1.0, kwargs={"k": 1}),
        RewardComponentConfig(name="soft_format", weight=0.5),
    ]
    assert cfg.actor.optim.betas == [0.9, 0.99]
    path = write(
        tmp_path,
        "reward:\n  models:\n    - {name: draw, kind: scene_renderer}\n"
        "    - {name: score, kind: scene_scorer, images_from: draw}\n"
        "  components: [{name: look, function: 'model:score'}]\n  val_metric: look\n",
    )
    models = load_config(path, ["reward.models[1].text=response", "reward.models.0.height=64"]).reward.models
    assert [(m.name, m.kind, m.height, m.text, m.images_from) for m in models] == [
        ("draw", "scene_renderer", 64, "prompt", ""),
        ("score", "scene_scorer", 512, "response", "draw"),
    ]


@pytest.mark.parametrize(
    "override, expected",
    [
        (
            "reward.judges[0].model=m",
            "config key 'reward.judges[0]': reward.judges has 0 entries; an index names an existing entry "
            "(to add one, set the whole list: reward.judges=[...])",
        ),
        ("reward.components.2.weight=1", "config key 'reward.components[2]': reward.components has 2 entries;"),
        ("actor.optim.betas[2]=1", "config key 'actor.optim.betas[2]': actor.optim.betas has 2 entries;"),
        ("reward[0].x=1", "config key 'reward' is not a list; [0] indexes a list's entries"),
        ("reward.judges[one].model=m", "override key 'reward.judges[one].model' is malformed"),
        ("trainer.seed.x=1", "config key 'trainer.seed' is a value, not a section"),
    ],
)
def test_an_index_past_the_end_or_in_the_wrong_place_is_one_line(override, expected):
    assert expected in config_error([override])


# ------------------------------------------------------------------------- close matches
@pytest.mark.parametrize(
    "override, expected",
    [
        (
            "actor_rollout_ref.actor.clip_ratio_lowz=3e-4",
            "1 verl override(s) not taken: actor_rollout_ref.actor.clip_ratio_lowz=3e-4 (did you mean "
            "actor_rollout_ref.actor.clip_ratio_low (actor.clip_low)?)",
        ),
        (
            "algorithm.kl_ctrl.kl_coeff=0.1",
            "unknown config key 'algorithm.kl_ctrl.kl_coeff'; did you mean algorithm.kl_ctrl.kl_coef (algorithm.kl_coef)?",
        ),
        ("data.shufle=false", "unknown config key 'data.shufle'; did you mean data.shuffle (data.sampler)?"),
        (
            "actor_rollout_ref.ref.fsdp_config.whatever=1",
            "1 verl override(s) not taken: actor_rollout_ref.ref.fsdp_config.whatever=1 (nothing in grouprl reads it "
            "(docs/verl-trl.md: the verl names grouprl reads))",
        ),
    ],
)
def test_a_mistyped_verl_key_names_its_leaf_and_the_close_verl_names(override, expected):
    assert config_error([override]) == expected


@pytest.mark.parametrize(
    "override, expected",
    [
        ("trainer.total_step=1", "unknown config key 'trainer.total_step'; did you mean trainer.total_steps? allowed in trainer: "),
        ("trainr.seed=1", "unknown config key 'trainr'; did you mean trainer.seed? allowed in the top level: "),
        ("judges[0].backend=openai", "unknown config key 'judges'; did you mean reward.judges[0].backend? allowed in"),
        ("lr=1e-5", "unknown config key 'lr'; did you mean actor.optim.lr or sft.optim.lr? allowed in"),
        (
            "reward.components[0].wieght=2",
            "unknown config key 'reward.components[0].wieght'; did you mean reward.components[0].weight? "
            "allowed in reward.components[0]: name, function, weight,",
        ),
        ("actor.optim.learning_rate=1", "unknown config key 'actor.optim.learning_rate'; allowed in actor.optim: lr,"),
    ],
)
def test_a_mistyped_key_names_the_close_keys(override, expected):
    assert config_error([override]).startswith(expected)


def test_close_matches_in_a_file_too(tmp_path):
    message = config_error(path=write(tmp_path, "trainer:\n  total_step: 3\n"))
    assert message.startswith("unknown config key 'trainer.total_step'; did you mean trainer.total_steps?")
    message = config_error(path=write(tmp_path, "actor_rollout_ref:\n  actor:\n    clip_ratio_low: 0.2\n", "v.yaml"))
    assert message == (
        "config key 'actor_rollout_ref.actor.clip_ratio_low' is a verl name, which only command-line overrides "
        "take; write actor.clip_low"
    )


# ------------------------------------------------------------------------- empty values
def test_an_empty_value_for_a_string_setting_means_the_empty_string(tmp_path):
    cfg = load_config(None, ["trainer.val_breakdown=kind", "trainer.val_breakdown="])
    assert cfg.trainer.val_breakdown == ""
    assert load_config(write(tmp_path, "trainer:\n  val_breakdown:\n")).trainer.val_breakdown == ""
    assert load_config(None, ["data.system_prompt="]).data.system_prompt is None  # may be null: stays null
