"""`trainer.launcher=ray`: the ranks run as Ray Train workers on a one-node cluster the test
starts on 127.0.0.1 and give the run of one process, as torchrun's ranks do (test_parallel.py);
a mistake a worker finds is one line; the placement of workers on a cluster; without Ray the
launcher names the extra to install."""

import logging
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from test_parallel import SETTINGS, assert_same_run, reference_run, setup  # noqa: F401 (setup: a fixture)

from grouprl.cli import main
from grouprl.config import load_config
from grouprl.errors import DataError, UserError
from grouprl.trainer.launch import _secrets, _user_error, placement
from helpers import free_port, run_grouprl
from test_cli import no_model_load, one_line_error  # noqa: F401 (no_model_load: a fixture)


# ------------------------------------------------------------------------- without a cluster
def test_without_ray_the_launcher_names_the_extra(capsys, monkeypatch, no_model_load):  # noqa: F811
    monkeypatch.setitem(sys.modules, "ray", None)  # as where Ray is not installed: import fails
    message = one_line_error(capsys, "train", "trainer.launcher=ray", "trainer.ray_workers=2")
    assert message == "trainer.launcher=ray needs Ray Train: pip install 'grouprl[ray]'"


def test_the_plan_names_the_launcher(capsys, no_model_load):  # noqa: F811
    assert main(["train", "--dry-run", "trainer.launcher=ray", "trainer.ray_workers=4"]) == 0
    plan = capsys.readouterr().out.splitlines()
    assert "  launch: 4 ranks as Ray Train workers (1 CPU each; a GPU each when the cluster has them)" in plan


def ray_config(*overrides):
    return load_config(None, ["trainer.launcher=ray", *overrides])


def test_placement_follows_the_device_and_the_cluster(caplog):
    cpus, gpus = {"CPU": 16.0}, {"CPU": 64.0, "GPU": 8.0}
    assert placement(ray_config("trainer.ray_workers=2"), cpus) == (2, False)
    assert placement(ray_config(), gpus) == (8, True)  # auto on GPUs: a rank per GPU
    assert placement(ray_config("trainer.ray_workers=4"), gpus) == (4, True)
    assert placement(ray_config("trainer.device=cpu", "trainer.ray_workers=4"), gpus) == (4, False)
    with pytest.raises(UserError, match=r"^set trainer.ray_workers .*: a CPU run has no GPU count to go by$"):
        placement(ray_config(), cpus)
    with pytest.raises(UserError, match="it has no GPUs now"):
        placement(ray_config("trainer.device=cuda"), cpus)
    # more than the cluster has now: a warning (an autoscaling cluster grows), not an error
    with caplog.at_level(logging.WARNING):
        assert placement(ray_config("trainer.ray_workers=4", "trainer.ray_cpus_per_worker=8"), cpus) == (4, False)
    assert "the Ray cluster has 16 CPUs and 0 GPUs; 4 workers need 32 CPUs: the run waits" in caplog.text


def test_the_secrets_the_config_names_travel_and_nothing_else(monkeypatch):
    monkeypatch.setenv("JUDGE_KEY", "k1")
    monkeypatch.setenv("OTHER", "x")
    monkeypatch.delenv("UNSET_KEY", raising=False)
    tree = {"reward": {"judges": [{"api_key_env": "JUDGE_KEY"}]}, "agent": {"answer_api_key_env": "UNSET_KEY"}}
    assert _secrets({**tree, "data": {"task": "OTHER", "none_env": ""}}) == {"JUDGE_KEY": "k1"}
    # the engine service's key, for a run whose ranks reach one
    monkeypatch.setenv("GROUPRL_ENGINE_KEY", "k" * 32)
    assert _secrets(tree) == {"JUDGE_KEY": "k1"}
    assert _secrets({**tree, "rollout": {"engine_address": "10.0.0.2:7100"}}) == {"JUDGE_KEY": "k1", "GROUPRL_ENGINE_KEY": "k" * 32}


def test_a_workers_user_error_is_found_under_rays_wrappers():
    class Wrapped(Exception):  # as Ray wraps a task's exception (RayTaskError.cause)
        def __init__(self, cause):
            self.cause = cause

    failed = RuntimeError("Training failed due to worker errors")
    failed.worker_failures = {1: Wrapped(DataError("bad row")), 0: ValueError("process group gone")}
    assert str(_user_error(failed)) == "bad row"
    assert _user_error(RuntimeError("a bug")) is None


# ------------------------------------------------------------------------- on a local cluster
@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """`ray start --head` on 127.0.0.1 (2 CPUs, no GPU, no dashboard, no usage stats, a token and
    a temp folder of its own): the environment a driver needs to reach it. Stopped with the
    module by ending the `ray start --block` this fixture started, which stops its processes."""
    pytest.importorskip("ray.train.torch")
    temp = Path(tempfile.mkdtemp(prefix="ray-"))  # short: Ray's sockets live there
    env = {
        "RAY_TMPDIR": str(temp),  # sessions and the "current cluster" file: not /tmp/ray's
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # one node on the loopback: Ray keeps 127.0.0.1
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(32),  # not written to ~/.ray
    }
    log = tmp_path_factory.mktemp("ray") / "head.log"
    port = free_port()
    command = [
        str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
        f"--port={port}", "--num-cpus=2", "--num-gpus=0", "--include-dashboard=false", "--disable-usage-stats",
    ]  # fmt: skip
    with log.open("w") as out:  # stopping drains nothing (no drain wait: nothing runs by then)
        head = subprocess.Popen(
            command, env={**os.environ, **env, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}, stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in log.read_text():
            assert head.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        assert "Local node IP: 127.0.0.1" in log.read_text()
        yield {**env, "RAY_ADDRESS": f"127.0.0.1:{port}"}
    finally:
        head.terminate()
        head.wait(timeout=120)
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.slow
def test_ray_workers_equal_one_process(setup, ray_cluster, monkeypatch):  # noqa: F811
    root, config = setup
    for name, value in ray_cluster.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(root)  # a relative output_dir: the workers resolve it from the driver's folder
    ray = ["trainer.launcher=ray", "trainer.ray_workers=2", "trainer.output_dir=runs"]

    one = reference_run(config, root)  # the one-process run (test_parallel.py's, when it ran)
    done = run_grouprl(1, "train", str(config), *SETTINGS, "trainer.experiment_name=ray", *ray)  # the driver
    assert "training on 2 Ray workers (CPU)" in done.stderr
    two = root / "runs" / "ray"
    assert_same_run(one, two, root / "model")
    assert sorted(p.name for p in two.iterdir()) == sorted(p.name for p in one.iterdir())  # nothing of Ray's
