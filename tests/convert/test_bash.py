"""The bash reader: a launch script walked as bash would walk it, nothing run. Each test's
script is written in the style of verl's current examples (arrays of arguments, a device chosen
by a probe, functions, launchers in front of python3 -m), and the expected argv is what bash
itself passes (worked out by reading the script as bash does)."""

import pytest

from grouprl.convert.bash_expand import SECRET, UNKNOWN, plain
from grouprl.convert.bash_lex import BashError
from grouprl.convert.bash_run import run_script

DEVICE_SCRIPT = r"""#!/usr/bin/env bash
set -xeuo pipefail
# the device, as the examples probe it
if python3 -c 'import torch_npu' >/dev/null 2>&1; then DEVICE=npu; else DEVICE=cuda; fi
NGPUS=$(nvidia-smi -L | wc -l)
case "$DEVICE" in
  npu) BATCH=16; RESP=$((1024 * 32)); OFFLOAD=True ;;
  cuda|gpu) BATCH=1024; RESP=$((1024 * 2)); OFFLOAD=False ;;
  *) BATCH=1 ;;
esac
[[ $NGPUS -ge 8 && "$DEVICE" == cu* ]] && TP=2 || TP=1
MODEL=${MODEL:-Qwen/Qwen2.5-7B-Instruct}
export VLLM_USE_V1=1
DATA=(
    data.train_files="$HOME/data/gsm8k/train.parquet"
    data.train_batch_size=${BATCH}
    data.max_response_length=$RESP
)
ACTOR=( actor_rollout_ref.model.path=$MODEL "actor_rollout_ref.actor.fsdp_config.param_offload=${OFFLOAD}" )
LAUNCH=(uv run --with verl python3)
extra_args() { echo "trainer.n_gpus_per_node=$1 trainer.nnodes=1"; }
run() {
    "${LAUNCH[@]}" -m verl.trainer.main_ppo "${DATA[@]}" "${ACTOR[@]}" \
        actor_rollout_ref.rollout.tensor_model_parallel_size=$TP $(extra_args "$NGPUS") "$@"
}
run trainer.experiment_name="grpo ${DEVICE}"
"""


def argv_of(text, env=None, args=()):
    shell = run_script(text, env if env is not None else {"HOME": "/home/me"}, None, "/work", list(args))
    return shell, [plain(w) for w in shell.calls[0].argv] if shell.calls else None


def test_arrays_functions_a_probed_device_and_uv_run_give_the_argv_bash_would():
    shell, argv = argv_of(DEVICE_SCRIPT)
    assert argv == [
        "uv", "run", "--with", "verl", "python3", "-m", "verl.trainer.main_ppo",
        "data.train_files=/home/me/data/gsm8k/train.parquet", "data.train_batch_size=1024",
        "data.max_response_length=2048", "actor_rollout_ref.model.path=Qwen/Qwen2.5-7B-Instruct",
        "actor_rollout_ref.actor.fsdp_config.param_offload=False",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "trainer.n_gpus_per_node=8", "trainer.nnodes=1",
        "trainer.experiment_name=grpo cuda",
    ]  # fmt: skip
    notes = "\n".join(shell.notes)
    assert "answered as on a GPU machine" in notes and "torch_npu" in notes and "nvidia-smi -L" in notes


def test_the_environment_decides_a_branch_and_a_default():
    _, argv = argv_of(DEVICE_SCRIPT.replace("NGPUS=$(nvidia-smi -L | wc -l)", "NGPUS=${NGPUS:-$(nvidia-smi -L | wc -l)}"),
                      env={"HOME": "/h", "MODEL": "/models/m", "NGPUS": "4"})  # fmt: skip
    assert "actor_rollout_ref.model.path=/models/m" in argv and "trainer.n_gpus_per_node=4" in argv
    assert "actor_rollout_ref.rollout.tensor_model_parallel_size=1" in argv  # [[ 4 -ge 8 ]] is false


@pytest.mark.parametrize(
    "launcher",
    [
        "ray job submit --address=http://127.0.0.1:8265 --runtime-env-json='{\"a\": 1}' -- python3 -m verl.trainer.main_ppo",
        "torchrun --nproc_per_node=8 -m verl.trainer.main_ppo",
        "PYTHONUNBUFFERED=1 nohup env A=1 python3 -m verl.trainer.main_ppo",
        "exec python3 recipe/dapo/main_dapo.py",
    ],
)
def test_launchers_in_front_of_the_trainer(launcher):
    _, argv = argv_of(f"N=5\n{launcher} actor_rollout_ref.rollout.n=$N 'trainer.project_name=a b' 2>&1 | tee log.txt\n")
    assert argv[-2:] == ["actor_rollout_ref.rollout.n=5", "trainer.project_name=a b"]


def test_parameter_expansions_bash_has():
    text = r"""
A=actor_rollout_ref.actor
X=qwen2.5-7b-instruct
P=/data/run.parquet
declare -A SIZE=([small]=8 [big]=64)
ARGS="$A.ppo_epochs=2 $A.ppo_mini_batch_size=${SIZE[big]}"
python3 -m verl.trainer.main_ppo ${ARGS//ppo_epochs/ppo_epochs} trainer.experiment_name=${X^^} \
  data.val_files=${P%.parquet}.jsonl data.train_files=${P##*/} trainer.project_name=${X:0:4} \
  trainer.total_epochs=${#X} trainer.save_freq=${UNSET-7} trainer.test_freq=${P:+3}
"""
    _, argv = argv_of(text)
    assert argv[3:] == [
        "actor_rollout_ref.actor.ppo_epochs=2", "actor_rollout_ref.actor.ppo_mini_batch_size=64",
        "trainer.experiment_name=QWEN2.5-7B-INSTRUCT", "data.val_files=/data/run.jsonl", "data.train_files=run.parquet",
        "trainer.project_name=qwen", "trainer.total_epochs=19", "trainer.save_freq=7", "trainer.test_freq=3",
    ]  # fmt: skip


def test_what_only_bash_knows_is_kept_as_written_and_marked():
    shell, _ = argv_of("python3 -m verl.trainer.main_ppo a.b=$UNSET_X c.d=`hostnamectl` e.f=$(ls /data | head -1) g.h=<(cat x)\n")
    raw = shell.calls[0].argv[3:]
    assert [plain(w) for w in raw] == ["a.b=$UNSET_X", "c.d=$(hostnamectl)", "e.f=$(ls /data | head -1)", "g.h=<(cat x)"]
    assert all(UNKNOWN in w for w in raw)


def test_a_secret_from_the_environment_stays_a_reference():
    env = {"MY_SECRET_TOKEN": "hunter2", "WANDB_API_KEY": "k-123", "max_token_len": "64"}
    shell, argv = argv_of("python3 -m verl.trainer.main_ppo a.key=${MY_SECRET_TOKEN} b.key=$WANDB_API_KEY c.len=$max_token_len\n", env)
    assert argv[3:] == ["a.key=${MY_SECRET_TOKEN}", "b.key=${WANDB_API_KEY}", "c.len=64"]
    assert SECRET in shell.calls[0].argv[3] and "hunter2" not in repr(shell.calls) + repr(shell.notes)


def test_arithmetic_is_bounded_and_what_leaves_64_bits_is_kept_as_written():
    terms = "+".join(["1"] * 3000)
    text = f"A=$((9**9**9)) B=$((2**64)) C=$((2**62)) D=$(({terms})) E=$((7/0)) F=$((-7/2)) G=$((0x10 + 2#101 + 010))\n"
    shell = run_script(text + "python3 -m verl.trainer.main_ppo a=$A b=$B c=$C d=$D e=$E f=$F g=$G\n", {}, None, "/", [])
    argv = [plain(w) for w in shell.calls[0].argv[3:]]
    assert argv == ["a=$((9**9**9))", "b=$((2**64))", f"c={2**62}", "d=3000", "e=$((7/0))", "f=-3", "g=29"]
    notes = "\n".join(shell.notes)
    assert "beyond 64-bit integers" in notes and "division by zero" in notes


@pytest.mark.parametrize(
    "text, said",
    [
        ("X=" + "${U:-" * 5000 + "x" + "}" * 5000 + "\n", "nested more than"),
        ("X=$((" + "(" * 5000 + "1" + ")" * 5000 + "))\npython3 -m verl.trainer.main_ppo a=$X\n", None),
        ("f() { f; }\nf\n", "calls nested more than"),
        ("while true; do :; done\n", "more than 100000 commands"),
        ("echo 'never closed\n", "single quote is never closed"),
        ("if true; then echo\n", "expected 'fi'"),
        ("case x in\n", "case pattern"),
    ],
)
def test_every_failure_is_one_line_of_the_readers_own(text, said):
    if said is None:  # 5,000 parentheses: the arithmetic's own cap, the text kept as written
        shell = run_script(text, {}, None, "/", [])
        assert "nested more than 32 levels" in "\n".join(shell.notes)
        return
    with pytest.raises(BashError, match=said) as caught:
        run_script(text, {}, None, "/", [])
    assert "\n" not in str(caught.value)


def test_heredocs_redirections_and_commands_are_not_run(tmp_path):
    target = tmp_path / "made.txt"
    text = f"""cat > {target} <<EOF
python3 -m verl.trainer.main_ppo a=heredoc
EOF
mkdir -p {tmp_path}/new && rm -rf /definitely/not && echo hi > {target}
python3 -m verl.trainer.main_ppo a=real >> {target} 2>&1
"""
    shell, argv = argv_of(text)
    assert argv[3:] == ["a=real"] and len(shell.calls) == 1
    assert not target.exists() and not (tmp_path / "new").exists()


def test_break_and_continue_leave_the_loops_bash_leaves():
    """Nested for, arithmetic for, while and until loops with break, continue and `continue 2`:
    the values bash itself gives (1a1b3a4a4bw1w2n0n2n3u)."""
    text = """OUT=""
for i in 1 2 3 4; do
  [[ $i == 2 ]] && continue
  for j in a b c; do
    [[ $j == b && $i == 3 ]] && continue 2
    [[ $j == c ]] && break
    OUT="$OUT$i$j"
  done
done
k=0
while true; do k=$((k+1)); [[ $k -ge 3 ]] && break; OUT="${OUT}w$k"; done
for ((n=0; n<5; n++)); do [[ $n == 1 ]] && continue; [[ $n == 4 ]] && break; OUT="${OUT}n$n"; done
until false; do OUT="${OUT}u"; break; done
python3 -m verl.trainer.main_ppo out=$OUT
"""
    shell = run_script(text, {}, None, "/", [])
    assert plain(shell.calls[0].argv[3]) == "out=1a1b3a4a4bw1w2n0n2n3u"
