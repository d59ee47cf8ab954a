"""DualPipe's overlapped pair: the forward of one micro-batch and the backward of another, interleaved
so that each one's communication (a MoE layer's dispatch and combine all-to-alls, a TP collective)
is in flight while the other computes.

The two run as coroutines on two threads — the forward on the caller's, the backward (an autograd
backward: it cannot be paused from outside) on a worker — and exactly one runs at a time. Each hands
over at every communication wait (comm.before_waits): it has just issued a transfer, so the other
computes while it travels; when it gets the thread back, it waits for what is left. The hand-over
points depend only on the program, never on timing, so every rank of a group switches at the same
points and issues its collectives in the same order (the all-to-alls of an expert-parallel group
pair up as in a plain run). One side finished, the other runs on without switching.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable

import torch

from ..runtime import comm


class PairRunner:
    """Runs (forward, backward) pairs; owns one worker thread for the backward sides."""

    def __init__(self) -> None:
        self._jobs: queue.Queue = queue.Queue()
        self._worker: threading.Thread | None = None
        self._cv = threading.Condition()
        self._turn = 0
        self._done = [False, False]

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            job()

    def _hand_over(self, me: int) -> None:
        """Give the thread to the other side (unless it finished) and wait until it is handed back."""
        with self._cv:
            if self._done[1 - me]:
                return
            self._turn = 1 - me
            self._cv.notify_all()
            while self._turn != me:
                self._cv.wait()

    def _finish(self, me: int) -> None:
        with self._cv:
            self._done[me] = True
            self._turn = 1 - me
            self._cv.notify_all()

    def run(self, forward: Callable[[], object], backward: Callable[[], None]):
        """forward() here and backward() on the worker, interleaved at communication waits; returns
        forward's result. An error on either side is raised here once both sides have stopped."""
        if self._worker is None:
            self._worker = threading.Thread(target=self._loop, daemon=True, name="overlapkit-pp-pair")
            self._worker.start()
        self._turn, self._done = 0, [False, False]
        errors: list[BaseException] = []
        finished = threading.Event()
        threads = torch.get_num_threads()

        def back_side() -> None:
            if torch.get_num_threads() != threads:  # per thread (OpenMP): the caller's, not every core
                torch.set_num_threads(threads)
            with self._cv:
                while self._turn != 1:
                    self._cv.wait()
            try:
                with comm.before_waits(lambda: self._hand_over(1)):
                    backward()
            except BaseException as e:  # raised in the caller's thread below
                errors.append(e)
            finally:
                self._finish(1)
                finished.set()

        self._jobs.put(back_side)
        out = None
        try:
            with comm.before_waits(lambda: self._hand_over(0)):
                out = forward()
        except BaseException as e:
            errors.insert(0, e)
        finally:
            self._finish(0)
        finished.wait()
        if errors:
            raise errors[0]
        return out
