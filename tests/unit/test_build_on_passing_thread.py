"""The executor loads its engine on a thread that ends with the load
(worker.build_on_passing_thread), so that the OpenMP pool of the load's parallel regions does not
outlive it."""

from __future__ import annotations

import os
import threading
import time

import pytest

from services.executor.worker import build_on_passing_thread


def _num_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_the_result_comes_from_another_thread_that_has_ended():
    caller = threading.current_thread()
    seen: list[threading.Thread] = []

    def build() -> int:
        seen.append(threading.current_thread())
        return 42

    assert build_on_passing_thread(build) == 42
    assert seen[0] is not caller
    assert not seen[0].is_alive()


def test_the_builds_exception_is_raised_to_the_caller():
    def build() -> int:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        build_on_passing_thread(build)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_the_openmp_pool_of_a_parallel_build_ends_with_it():
    import torch

    counts: list[int] = []

    def build() -> float:
        torch.set_num_threads(2)  # a pool thread beside this one, even on one core
        total = float(torch.ones(1 << 22).sum())  # large enough for at::parallel_for to split
        counts.append(_num_threads())
        return total

    # torch's first such use starts threads of its own that stay: count from after it
    build_on_passing_thread(build)
    time.sleep(0.2)
    before = _num_threads()
    assert build_on_passing_thread(build) == float(1 << 22)
    assert counts[-1] >= before + 2  # the build's thread and its pool's
    # The pool's threads leave as their master thread ends, a moment after it.
    assert _wait_for_threads(before) == before


def _wait_for_threads(count: int, timeout_s: float = 5.0) -> int:
    deadline = time.monotonic() + timeout_s
    while _num_threads() != count and time.monotonic() < deadline:
        time.sleep(0.01)
    return _num_threads()
