"""The two processes' rendezvous over their own connection (rendezvous.py): keys kept on the
host side, requests from the other side one at a time (NCCL's monitoring thread may ask beside
the main thread), the processes' own messages passing beside them on the same connection, the
other side's failure raised where the host waits, and the store answering for the group's
whole life: a second group formed over it after the first has been used."""

import multiprocessing
import threading

import pytest
import torch
import torch.distributed as dist

from grouprl.rollout.engines.rendezvous import Channel, ConnectionStore


def pair(timeout_s=10):
    here, there = multiprocessing.Pipe()
    host = ConnectionStore(Channel(here), host=True, timeout_s=timeout_s)
    other = ConnectionStore(Channel(there), host=False, timeout_s=timeout_s)
    return host, other


def test_two_threads_asking_at_once_each_get_their_own_answer_beside_the_processes_messages():
    host, other = pair()
    for i in range(50):
        host.set(f"k{i}", f"v{i}".encode())
    got: dict[str, list] = {"a": [], "b": []}

    def ask(name, keys):
        for k in keys:
            got[name].append(other.get(k) if name == "a" else other.check([k]))

    threads = [threading.Thread(target=ask, args=("a", [f"k{i}" for i in range(50)])),
               threading.Thread(target=ask, args=("b", [f"k{i}" for i in range(50)]))]  # fmt: skip
    for t in threads:
        t.start()
    for i in range(20):  # the trainer's requests and the engine's answers go on meanwhile
        host.channel.send(("generate", i))
        assert other.channel.recv() == ("generate", i)
        other.channel.send(("ok", i))
        assert host.channel.poll(5) and host.channel.recv() == ("ok", i)
    for t in threads:
        t.join(timeout=20)
    assert got["a"] == [f"v{i}".encode() for i in range(50)] and got["b"] == [True] * 50


def test_every_method_c10d_dispatches_answers_from_the_other_side():
    host, other = pair()
    store = dist.PrefixStore("p", other)  # as ProcessGroupNCCL wraps it, calling from C++
    store.set("a", b"1")
    assert store.get("a") == b"1" and host.get("p/a") == b"1"
    assert store.add("n", 2) == 2 and store.add("n", 3) == 5
    assert store.compare_set("c", b"", b"x") == b"x" and store.compare_set("c", b"y", b"z") == b"x"
    store.append("a", b"2")
    assert store.multi_get(["a", "c"]) == [b"12", b"x"]
    store.multi_set(["d", "e"], [b"4", b"5"])
    assert store.check(["d", "e"]) and not store.check(["f"])
    store.wait(["d"])
    assert other.delete_key("p/d") and other.num_keys() == host.num_keys() == 4
    with pytest.raises(RuntimeError, match="did not come"):
        other.wait(["p/never"], __import__("datetime").timedelta(seconds=0.2))
    with pytest.raises(NotImplementedError, match="queue"):  # what c10d does not dispatch says what it is
        store.queue_push("q", b"1")


def test_the_other_sides_error_while_forming_is_raised_where_the_host_waits():
    here, there = multiprocessing.Pipe()
    host = ConnectionStore(Channel(here), host=True, timeout_s=10)
    there.send(("error", "RuntimeError", "CUDA out of memory", "trace"))  # the engine's report
    with pytest.raises(RuntimeError, match="failed while the weights' group formed: CUDA out of memory"):
        host.get("0/1")
    assert host.channel.recv()[0] == "error"  # and its message reaches the trainer's reader as it is
    there.close()


def test_the_other_side_ending_is_raised_too():
    here, there = multiprocessing.Pipe()
    host = ConnectionStore(Channel(here), host=True, timeout_s=10)
    there.close()
    with pytest.raises(RuntimeError, match="ended while the weights' group formed"):
        host.get("0/1")
    with pytest.raises(EOFError):
        host.channel.recv()


def _groups(rank: int, conn, got=None) -> None:
    """Two gloo groups over one ConnectionStore, the second formed after the first broadcast and
    a request/answer on the channel, as NCCL makes a later communicator over its store."""
    store = ConnectionStore(Channel(conn), host=rank == 0, timeout_s=30)
    first = dist.ProcessGroupGloo(dist.PrefixStore("first", store), rank, 2)
    value = torch.tensor([7.0 if rank == 0 else 0.0])
    first.broadcast([value]).wait()
    if rank == 0:
        store.channel.send(("generate", 1))
        assert store.channel.recv() == ("ok", 1)
    else:
        assert store.channel.recv() == ("generate", 1)
        store.channel.send(("ok", 1))
    second = dist.ProcessGroupGloo(dist.PrefixStore("second", store), rank, 2)
    value2 = torch.tensor([3.0 if rank == 0 else 0.0])
    second.broadcast([value2]).wait()
    assert (value.item(), value2.item()) == (7.0, 3.0)  # both groups carried rank 0's values
    if got is not None:
        got.append(rank)


@pytest.mark.slow  # a spawned process: about 2 s
def test_a_second_group_forms_over_the_store_after_the_first():
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    child = ctx.Process(target=_groups, args=(1, there))
    child.start()
    got: list[int] = []
    host = threading.Thread(target=_groups, args=(0, here, got), daemon=True)
    host.start()
    child.join(timeout=60)
    host.join(timeout=10)
    assert child.exitcode == 0 and got == [0]
