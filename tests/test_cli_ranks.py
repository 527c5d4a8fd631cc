"""A user's mistake under torchrun (2 CPU ranks, gloo): one line from one rank, and every rank
leaves with status 2, as one process does, without tracebacks of its own; a rank that waits in
a collective for the rank that found the mistake leaves too. torchrun itself then reports the
failed ranks (its ChildFailedError, status 1) whatever they exit with: that part is its own."""

import os
import re
import subprocess
import sys

import pytest

from helpers import free_port

LINE = "grouprl: error: "




def torchrun(*command: str, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launcher = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
    ]  # fmt: skip
    return subprocess.run([*launcher, *command], env=env, cwd=cwd, capture_output=True, text=True, timeout=120)


def rank_exit_codes(output: str) -> list[int]:
    """The exit codes torchrun's failure report gives the ranks."""
    return [int(code) for code in re.findall(r"exitcode\s*: (-?\d+)", output)]


def check_reported_once(done: subprocess.CompletedProcess, message: str) -> None:
    output = done.stdout + done.stderr
    assert output.count(LINE) == 1, output
    assert f"{LINE}{message}\n" in done.stderr
    assert done.returncode != 0
    codes = rank_exit_codes(output)
    assert codes and set(codes) == {2}, output  # no rank killed by a signal, none with a traceback's 1
    assert output.count("Traceback") <= 1, output  # torchrun's own report, no rank's
    assert "grouprl/cli.py" not in output, output


@pytest.mark.slow
def test_a_mistake_every_rank_finds_is_one_line_and_status_2(tmp_path):
    """The batch does not split over 2 ranks: found by both, after they joined the group."""
    done = torchrun(
        "-m", "grouprl", "train", "data.train_batch_size=3", "data.task_train_size=8", "data.task_val_size=4",
        "trainer.device=cpu", f"trainer.output_dir={tmp_path}/runs", cwd=tmp_path,
    )  # fmt: skip
    check_reported_once(done, "data.train_batch_size=3 must be a multiple of the number of ranks (2)")
    assert not (tmp_path / "runs").exists()


ONE_RANK = """
import sys

import torch.distributed as dist

import grouprl.cli as cli
from grouprl.errors import UserError


def train(args):
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        raise UserError("a mistake only rank 1 finds")
    dist.barrier()  # rank 0 waits for rank 1, which never comes
    return 0


cli.cmd_train = train
sys.exit(cli.main(["train"]))
"""


@pytest.mark.slow
def test_a_mistake_one_rank_finds_stops_the_rank_waiting_for_it(tmp_path):
    script = tmp_path / "one_rank.py"
    script.write_text(ONE_RANK)
    done = torchrun(str(script), cwd=tmp_path)
    check_reported_once(done, "a mistake only rank 1 finds")
