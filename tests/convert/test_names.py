"""One table of verl's and TRL's names: the translator, the docstrings' notes and
`grouprl train --explain KEY` all come from it (config/verl.py, config/trl.py)."""

import inspect
import re

from grouprl.cli import main
from grouprl.config import explain
from grouprl.config.docs import explain_key
from grouprl.config.tree import all_keys
from grouprl.config.trl import TRL_KEYS
from grouprl.config.verl import GATES, VERL_KEYS


def test_no_docstring_carries_a_hand_written_verl_note():
    import grouprl.config as config

    for name in ("actor", "data", "model", "rollout", "reward", "trainer", "curriculum", "sft"):
        source = inspect.getsource(getattr(config, name))
        assert not re.search(r"\(verl: |; verl: ", source), name


def test_every_translated_setting_lists_its_verl_and_trl_names_from_the_table():
    lines = {line.split(" = ")[0]: line for line in explain() if " = " in line}
    for verl, ours in VERL_KEYS.items():
        assert ours in all_keys() and verl in lines[ours], (verl, ours)
    for gate, (_, ours) in GATES.items():
        assert f"{gate} (a gate: false sets 0)" in lines[ours]
    for trl, ours in TRL_KEYS.items():
        target = ours.split(" ")[0]
        if target in all_keys():
            assert "TRL: " in lines[target] and trl in lines[target].split("TRL: ")[1], (trl, target)


def test_explain_one_key_by_any_of_its_names(capsys):
    assert explain_key("actor.mini_batch_size") == [
        "actor.mini_batch_size = 0  # Prompts per optimizer step; 0 = the whole batch, one step. "
        "(verl: actor_rollout_ref.actor.ppo_mini_batch_size)",
        "  checked: config key 'actor.mini_batch_size' ({...}) must divide data.train_batch_size ({...})",
        "  checked: config key 'actor.mini_batch_size' must be >= 0, got {...}",
    ]
    assert explain_key("actor_rollout_ref.actor.clip_ratio_low")[0] == "actor_rollout_ref.actor.clip_ratio_low (verl) sets actor.clip_low"
    assert explain_key("num_generations")[1].startswith("rollout.n_agent = ")
    assert explain_key("actor_rollout_ref.actor.use_kl_loss") == [
        "actor_rollout_ref.actor.use_kl_loss: a verl gate: false sets actor.kl_loss_coef to 0"
    ]
    assert main(["train", "--explain", "actor.clip_lwo"]) == 2
    assert "did you mean actor.clip_low?" in capsys.readouterr().err
    assert main(["train", "--explain", "algorithm"]) == 0
    shown = capsys.readouterr().out.splitlines()
    assert shown[0].startswith("# algorithm:") and all(line.startswith(("algorithm.", "# algorithm")) for line in shown)
