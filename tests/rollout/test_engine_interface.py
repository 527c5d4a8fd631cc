"""What callers ask of an engine, declared on `RolloutEngine` and answered by every engine: the
built-in engine here (the vLLM engine in test_engine_sleep.py, the engine process in
test_engine_process.py); the metrics the trainer makes of it; and the row streams' state, which
an engine process hands back."""

import json

import numpy as np
import pytest
import torch

from grouprl.config import load_config
from grouprl.rollout.engines.base import RolloutEngine, SamplingParams
from grouprl.rollout.engines.hf import HFEngine
from grouprl.rollout.engines.streams import RowStreams
from grouprl.trainer.trainer import Trainer
from helpers import tiny_model_and_tokenizer
from trainer.tiny import tiny_model_dir, write_run_config

# every member callers may ask for, beyond generation
ASKED = ["reads_trainer_weights", "push_seconds", "last_sleep_freed_bytes", "policy_version", "close", "offer_weights"]


def test_the_interface_declares_what_callers_ask():
    declared = set(RolloutEngine.__annotations__) | {n for n in vars(RolloutEngine) if not n.startswith("_")}
    assert set(ASKED) <= declared
    for name in ASKED[:4]:  # each data member documented where it is declared
        assert name in RolloutEngine.__annotations__


def test_the_built_in_engine_reads_the_trainers_weights_and_pushes_nothing():
    model, tokenizer = tiny_model_and_tokenizer(dtype=torch.float64, seed=0)
    engine = HFEngine(model, tokenizer)
    assert isinstance(engine, RolloutEngine)  # every member of the interface
    assert not isinstance(object(), RolloutEngine)  # the check can fail
    engine.weights_updated(model)
    engine.generate([[3, 4, 5]], 2, SamplingParams(max_new_tokens=3))
    assert engine.reads_trainer_weights is True
    assert engine.push_seconds == 0.0 and engine.last_sleep_freed_bytes == 0
    engine.close()
    assert len(engine.generate([[3, 4]], 1, SamplingParams(max_new_tokens=2))) == 1  # close ended nothing


def test_offered_weights_are_taken_before_the_next_call_and_name_its_version():
    """offer_weights (from any thread) waits until the engine runs no turn: the next call takes
    the newest offer into the model and its generations carry that version; an offer no newer
    than what the engine holds is dropped."""
    model, tokenizer = tiny_model_and_tokenizer(dtype=torch.float64, seed=0)
    engine = HFEngine(model, tokenizer)
    params = SamplingParams(max_new_tokens=3)
    engine.weights_updated(model, 3)
    assert [g.version for g in engine.generate([[3, 4, 5]], 2, params)] == [3, 3]
    name, weight = next(iter(model.named_parameters()))
    before = weight.detach().clone()
    engine.offer_weights(5, {name: torch.zeros_like(weight)})
    engine.offer_weights(4, {name: before + 2})  # older than the offer waiting: ignored
    assert engine.policy_version == 3 and torch.equal(weight, before)  # nothing taken between calls
    assert [g.version for g in engine.generate([[3, 4, 5]], 2, params)] == [5, 5]
    assert engine.policy_version == 5 and not weight.any()
    engine.offer_weights(5, {name: before})  # not newer than the engine's: dropped
    engine.generate([[3, 4]], 1, params)
    assert engine.policy_version == 5 and not weight.any()
    engine.weights_updated(model)  # a synchronous update names no version
    assert engine.generate([[3, 4]], 1, params)[0].version is None


@pytest.mark.parametrize("staleness", [0, 1])
def test_the_built_in_engine_logs_no_push_of_its_own(tmp_path, staleness):
    """time/weight_push: never on the built-in engine in a synchronous run (nothing is pushed);
    in an asynchronous one the pipeline's figure (the copy's load), once a step. Never
    perf/engine_freed_gb: nothing sleeps."""
    model_dir = tiny_model_dir(tmp_path / "model")
    config = write_run_config(tmp_path, model_dir)
    settings = ["rollout.engine=hf", "trainer.total_steps=2", "trainer.save_final=false", "trainer.test_freq=0",
                "trainer.val_before_train=false", f"rollout.max_staleness={staleness}"]  # fmt: skip
    Trainer(load_config(config, settings)).fit()
    records = [json.loads(x) for x in (tmp_path / "runs" / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "time/weight_sync" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert [("time/weight_push" in r) for r in steps] == [bool(staleness)] * 2
    assert not any("perf/engine_freed_gb" in r for r in records)


# ------------------------------------------------------------------ row streams' state
def test_row_streams_go_on_from_a_state_taken_elsewhere():
    here = RowStreams(11, [5, 9, 2, 7])
    here.select([1, 3]).uniform()
    here.uniform()
    state = here.state()
    assert state.tolist() == [1, 2, 1, 2]  # draws so far, every row (also those a view left out)
    there = RowStreams(11, [5, 9, 2, 7])
    there.select([2]).restore(state)  # a view restores every row: it shares the counters
    assert torch.equal(there.uniform(), here.uniform())
    assert not torch.equal(RowStreams(11, [5, 9, 2, 7]).uniform(), there.uniform())  # fresh streams differ


def test_a_row_streams_state_is_a_copy_and_must_fit():
    streams = RowStreams(3, range(3))
    state = streams.state()
    state += np.uint64(5)
    assert streams.state().tolist() == [0, 0, 0]  # the copy changed, not the streams
    with pytest.raises(ValueError, match="2 rows for 3 row streams"):
        streams.restore(np.zeros(2, dtype=np.uint64))
