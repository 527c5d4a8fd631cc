"""The two processes' rendezvous over their own connection (rendezvous.py): keys kept on the
host side, requests from the other side one at a time (NCCL's monitoring thread may ask beside
the main thread), and the other side's failure while the group forms raised where it waits."""

import multiprocessing
import threading

import pytest

from grouprl.rollout.engines.rendezvous import ConnectionStore


def test_two_threads_asking_at_once_each_get_their_own_answer():
    here, there = multiprocessing.Pipe()
    host = ConnectionStore(here, host=True, timeout_s=10)
    host.serve()
    for i in range(50):
        host.set(f"k{i}", f"v{i}".encode())
    other = ConnectionStore(there, host=False, timeout_s=10)
    got: dict[str, list] = {"a": [], "b": []}

    def ask(name, keys):
        for k in keys:
            got[name].append(other.get(k) if name == "a" else other.check([k]))

    threads = [threading.Thread(target=ask, args=("a", [f"k{i}" for i in range(50)])),
               threading.Thread(target=ask, args=("b", [f"k{i}" for i in range(50)]))]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert got["a"] == [f"v{i}".encode() for i in range(50)] and got["b"] == [True] * 50
    other.formed()
    host.formed()  # the host's server saw DONE and ended
    assert other.check(["k1"]) is False  # formed: a late check is answered here, nothing sent


def test_the_other_sides_error_while_forming_is_raised_where_the_host_waits():
    here, there = multiprocessing.Pipe()
    host = ConnectionStore(here, host=True, timeout_s=10)
    host.serve()
    there.send(("error", "RuntimeError", "CUDA out of memory", "trace"))  # the engine's report
    with pytest.raises(RuntimeError, match="failed while the weights' group formed: CUDA out of memory"):
        host.get("0/1")
    there.close()


def test_the_other_side_ending_is_raised_too():
    here, there = multiprocessing.Pipe()
    host = ConnectionStore(here, host=True, timeout_s=10)
    host.serve()
    there.close()
    with pytest.raises(RuntimeError, match="ended while the weights' group formed"):
        host.get("0/1")
