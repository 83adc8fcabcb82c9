"""Releasing a thread's OpenMP workers (the server's main thread, once the engine thread runs every forward)."""

from __future__ import annotations

import os
import threading
import time

import torch

from specdecode.model import openmp
from specdecode.model.openmp import release_thread_workers


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_released_workers_are_gone_and_come_back_on_demand() -> None:
    big = torch.ones(1 << 22)
    big.add_(1)  # a parallel region: this thread's pool of workers exists now
    before = _threads()
    release_thread_workers()
    # Its workers end (a thread leaves /proc once it has exited).
    if torch.get_num_threads() > 1 and openmp._runtime() is not None:
        deadline = time.monotonic() + 10
        while _threads() >= before and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _threads() < before
    assert big.add_(1).sum().item() == 3 * (1 << 22)  # the next parallel region makes new ones


def test_another_thread_computes_after_the_release() -> None:
    torch.ones(1 << 22).add_(1)
    release_thread_workers()
    out: list[float] = []
    worker = threading.Thread(target=lambda: out.append(torch.ones(1 << 22).sum().item()))
    worker.start()
    worker.join()
    assert out == [float(1 << 22)]
