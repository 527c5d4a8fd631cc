"""MicroBatcher: concurrent submits become few batches, results and errors reach every caller."""

import asyncio

import pytest

from grouprl.retriever.batching import MicroBatcher


class Recorder:
    """A batch function that records its batches and answers item -> item * 10."""

    def __init__(self, delay: float = 0.0, fail: Exception | None = None):
        self.batches: list[list[int]] = []
        self.delay = delay
        self.fail = fail

    async def __call__(self, items):
        self.batches.append(list(items))
        await asyncio.sleep(self.delay)
        if self.fail is not None:
            raise self.fail
        return [item * 10 for item in items]


def test_concurrent_submits_form_one_batch_with_duplicates_once():
    recorder = Recorder()
    batcher = MicroBatcher(recorder, window_s=0.01)

    async def run():
        return await asyncio.gather(*(batcher.submit(i % 5) for i in range(16)))

    assert asyncio.run(run()) == [(i % 5) * 10 for i in range(16)]
    assert recorder.batches == [[0, 1, 2, 3, 4]] and batcher.batches == 1


def test_max_batch_splits_and_calls_during_a_batch_wait_for_the_next():
    recorder = Recorder(delay=0.05)
    batcher = MicroBatcher(recorder, window_s=0.0, max_batch=4, max_in_flight=1)

    async def run():
        first = [asyncio.ensure_future(batcher.submit(i)) for i in range(10)]
        await asyncio.sleep(0.01)  # the first batch is running now
        later = [asyncio.ensure_future(batcher.submit(i)) for i in range(100, 103)]
        return await asyncio.gather(*first, *later)

    assert asyncio.run(run()) == [i * 10 for i in range(10)] + [1000, 1010, 1020]
    # one batch in flight at a time; whatever queued meanwhile leaves together, 4 at most
    assert recorder.batches == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 100, 101], [102]]


def test_a_failing_batch_fails_every_caller_and_the_next_batch_runs():
    recorder = Recorder(fail=ConnectionError("down"))
    batcher = MicroBatcher(recorder, window_s=0.0)

    async def run():
        failed = await asyncio.gather(*(batcher.submit(i) for i in range(3)), return_exceptions=True)
        recorder.fail = None
        return failed, await batcher.submit(7)

    failed, after = asyncio.run(run())
    assert [type(e) for e in failed] == [ConnectionError] * 3 and after == 70


def test_wrong_result_count_is_an_error():
    async def short(items):
        return items[:-1]

    batcher = MicroBatcher(short)
    with pytest.raises(RuntimeError, match="batch function returned 1 results for 2 items"):

        async def run():
            return await asyncio.gather(batcher.submit(1), batcher.submit(2))

        asyncio.run(run())


def test_works_across_event_loops():
    recorder = Recorder()
    batcher = MicroBatcher(recorder)
    assert asyncio.run(batcher.submit(1)) == 10
    assert asyncio.run(batcher.submit(2)) == 20
    assert recorder.batches == [[1], [2]]
    with pytest.raises(ValueError):
        MicroBatcher(recorder, max_batch=0)


def test_max_cost_bounds_a_batch_and_one_costly_item_still_runs():
    recorder = Recorder(delay=0.02)
    batcher = MicroBatcher(recorder, window_s=0.0, max_batch=10, max_cost=10, cost=lambda item: item)

    async def run():
        return await asyncio.gather(*(batcher.submit(i) for i in (3, 4, 5, 30, 1, 2)))

    assert asyncio.run(run()) == [30, 40, 50, 300, 10, 20]
    # 3 + 4 fit in 10, 5 does not; 30 alone is over the bound but runs by itself
    assert recorder.batches == [[3, 4], [5], [30], [1, 2]]


def test_calls_cancelled_while_waiting_are_not_run():
    recorder = Recorder(delay=0.05)
    batcher = MicroBatcher(recorder, window_s=0.0, max_batch=2)

    async def run():
        calls = [asyncio.ensure_future(batcher.submit(i)) for i in range(6)]
        await asyncio.sleep(0.01)  # [0, 1] is running, the rest wait
        calls[2].cancel()
        calls[4].cancel()
        return await asyncio.gather(*calls, return_exceptions=True)

    outcomes = asyncio.run(run())
    assert [type(o) if isinstance(o, BaseException) else o for o in outcomes] == [
        0,
        10,
        asyncio.CancelledError,
        30,
        asyncio.CancelledError,
        50,
    ]
    assert recorder.batches == [[0, 1], [3, 5]]


def test_isolating_failures_fails_only_the_bad_items():
    async def fussy(items):
        fussy.batches.append(list(items))
        if 13 in items or 6 in items:
            raise ValueError(f"unlucky batch {items}")
        return [item * 10 for item in items]

    fussy.batches = []
    batcher = MicroBatcher(fussy, window_s=0.01, isolate_failures=True)

    async def run():
        return await asyncio.gather(
            *(batcher.submit(i) for i in [1, 13, 2, 3, 13, 4, 5, 6]), return_exceptions=True
        )

    outcomes = asyncio.run(run())
    assert [str(o) if isinstance(o, ValueError) else o for o in outcomes] == [
        10,
        "unlucky batch [13]",
        20,
        30,
        "unlucky batch [13]",
        40,
        50,
        "unlucky batch [6]",
    ]
    # halves of the failed batch until each failure is alone (duplicates once)
    assert fussy.batches == [
        [1, 13, 2, 3, 4, 5, 6],
        [1, 13, 2],
        [1],
        [13, 2],
        [13],
        [2],
        [3, 4, 5, 6],
        [3, 4],
        [5, 6],
        [5],
        [6],
    ]
    assert batcher.batches == 11
