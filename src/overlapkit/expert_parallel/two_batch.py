"""Two micro-batches through one MoE block in inference: one micro-batch's dispatch and combine all-to-alls in flight while the other computes (its router, shared expert and permute, then its expert GEMMs).

SGLang's two-batch overlap, inside a block. In a forward without gradients (`generate`) the batch's
sequences are cut in two, A (the first half, rounded up) and B, and the block's own forward runs once
for each, taking turns: exactly one runs at a time (A on the caller's thread, B on a worker thread the
model's blocks share), and the turn passes at fixed points of the experts call, so every rank issues its collectives
in one order:

    A: counts, dispatch A ->|                         |-> wait A, experts A, combine A ->|            |-> wait, sum A, rest of A's block
    B:                      |-> router, shared expert, |                                 |-> wait B,   |
                            |   counts, permute,       |                                 |   experts B,|
                            |   dispatch B             |                                 |   combine B |-> (after A) wait, sum B, rest

so A's dispatch flies under B's router, shared expert and permute, B's dispatch under A's expert
GEMMs, A's combine under B's expert GEMMs and B's combine under A's weighted sum and the rest of A's
block. The micro-batches are the same computation as one batch (each token routed and computed
alone; only the GEMMs' row counts differ), so the tokens of `generate` are the one-batch tokens.

Batch 1 falls back: A's count exchange also tells every EP rank how many tokens each rank's B holds;
when none holds any, B never starts and the block runs exactly one micro-batch's collectives. A rank
whose B is empty while a peer's is not still takes B's turns with zero rows (the all-to-alls pair up).
"""

from __future__ import annotations

import contextvars
import queue
import threading
from typing import Callable, Sequence

import torch

from ..runtime import comm
from ..runtime.recorder import active, compute_span, wait_range
from .dispatch import _slots, plan_dispatch
from .moe import _WeightedSum


class MicroBatchAborted(RuntimeError):
    """Raised in one micro-batch when the other failed: it unwinds instead of waiting for a turn that never comes."""


class MicroBatchWorker:
    """The thread micro-batch B runs on, kept for a model's life and shared by its MoE blocks (they run one after
    another): a thread started per block call would pay its start in every layer of every decode step, a stretch
    in which neither micro-batch computes."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, job: Callable[[], None]) -> None:
        """Run `job` on the worker thread (started on first use, and again in a forked child, where it is gone)."""
        if self._thread is None or not self._thread.is_alive():
            self._jobs = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._loop, args=(self._jobs,), daemon=True,
                                            name="overlapkit-micro-batch-b")
            self._thread.start()
        self._jobs.put(job)

    @staticmethod
    def _loop(jobs: queue.SimpleQueue) -> None:
        while True:
            jobs.get()()

    def __deepcopy__(self, memo):  # a thread is not copied: the copy starts its own on first use
        return MicroBatchWorker()


class TwoBatch:
    """The turns of one block call's two micro-batches, and the experts call each of them makes.

    `second()` runs micro-batch B (the block's forward on its sequences, or `empty_experts(...)` when this
    rank's B has no sequence); `second_tokens` is how many tokens it routes. The caller runs A itself,
    then `finish()`; any failure in either ends both (`abort`).
    """

    def __init__(self, second: Callable[[], object], second_tokens: int, worker: MicroBatchWorker,
                 name: str = "moe") -> None:
        self._second, self.second_tokens, self._worker, self.name = second, second_tokens, worker, name
        self._cv = threading.Condition()
        self._turn = 0
        self._done = [False, False]
        self._error: BaseException | None = None
        self._started = False
        self._handed = None  # the host stamp of the last hand-over, while a recorder runs on the host clock
        self._first = threading.get_ident()
        self._result = None
        self.needed = False
        """Some EP rank's B holds tokens (learnt in A's count exchange): B runs, on every rank."""
        self.empty_args: tuple | None = None
        """A's experts arguments cut to zero rows: what a rank with an empty B routes in B's turns."""

    # -- turns -----------------------------------------------------------------------------------
    def index(self) -> int:
        """The micro-batch the calling thread runs: 0 (A) or 1 (B)."""
        return 0 if threading.get_ident() == self._first else 1

    def switch(self) -> None:
        """Hand the turn to the other micro-batch and wait until it comes back (nothing when the other has
        finished, or B is not needed)."""
        me = self.index()
        if not self.needed or self._done[1 - me]:
            return
        if me == 0 and not self._started:
            self._start()
        # A profiler trace's reader carves each thread's waits from its own compute ranges: the stretch a
        # micro-batch waits for its turn is not its compute (the other's compute range covers it). The recorder
        # keeps one host lane for every thread, where the other micro-batch's compute is what runs meanwhile.
        with self._cv, wait_range():
            self._hand_over(1 - me)
            self._wait_turn(me)
        self._gap()

    def _hand_over(self, to: int) -> None:
        rec = active()
        self._handed = rec.now() if rec is not None and not rec.cuda else None
        self._turn = to
        self._cv.notify_all()

    def _gap(self) -> None:
        """The stretch from the other's hand-over until this thread ran again computed nothing (the waking
        thread is scheduled late on a loaded host): not compute for the recorder, whose one host lane cannot
        tell which thread a compute span's time belongs to."""
        rec = active()
        if rec is not None and not rec.cuda and self._handed is not None:
            rec.blocked(self._handed, rec.now())

    def _wait_turn(self, me: int) -> None:
        while self._turn != me and self._error is None and not self._done[1 - me]:
            self._cv.wait()
        if self._error is not None:
            if isinstance(self._error, MicroBatchAborted) or me == 1:
                raise MicroBatchAborted("the other micro-batch of this MoE block failed")
            raise self._error

    def _start(self) -> None:
        inference = torch.is_inference_mode_enabled()
        device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        stream = torch.cuda.current_stream() if device is not None else None
        context = contextvars.copy_context()  # what the caller's context holds (a model's output collectors)

        def body():
            with self._cv:
                self._wait_turn(1)
            self._gap()
            try:
                with torch.inference_mode(inference), torch.no_grad(), compute_span(f"{self.name}.micro_batch[1]"):
                    if stream is not None:  # the stream is per thread: B queues its kernels where A does
                        with torch.cuda.device(device), torch.cuda.stream(stream):
                            self._result = context.run(self._second)
                    else:
                        self._result = context.run(self._second)
            except BaseException as e:  # noqa: BLE001 (handed to A, which raises it)
                with self._cv:
                    self._error = self._error or e
            finally:
                with self._cv:
                    self._done[1] = True
                    self._hand_over(0)

        self._started = True
        self._worker.submit(body)

    def finish(self):
        """A is done: B runs to its end (if it ran at all); its result, or None when B never started."""
        if not self._started:
            return None
        with self._cv:
            self._done[0] = True
            self._hand_over(1)
            while not self._done[1]:
                self._cv.wait()
        self._gap()
        if self._error is not None:
            raise self._error
        return self._result

    def abort(self) -> None:
        """A failed: B unwinds at its next turn (raising MicroBatchAborted), and A waits until it has."""
        with self._cv:
            self._error = self._error or MicroBatchAborted("micro-batch A of this MoE block failed")
            self._done[0] = True
            self._cv.notify_all()
            while self._started and not self._done[1]:
                self._cv.wait()

    # -- the experts call of either micro-batch ------------------------------------------------
    def experts(self, router, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                run, weights: Sequence[torch.Tensor]) -> torch.Tensor:
        """`DispatchCombine`'s call for the micro-batch of the calling thread: x [tokens, hidden] -> [tokens,
        hidden], one chunk, the turn handed over after the dispatch and after the combine are issued."""
        mb, group, width = self.index(), router.group, x.shape[-1]
        name = f"{router.name}.infer"
        if mb == 0:
            self.empty_args = (x[:0], top_k_index[:0], top_k_weights[:0])
        plan = plan_dispatch(top_k_index.long(), router.num_experts, 1, None, group, f"{name}[{mb}]",
                             cache=router._constants, announce=self.second_tokens if mb == 0 else None)
        if mb == 0:
            self.needed = any(plan.announced)
        rows = x.index_select(0, plan.row_token)
        total = plan.recv_rows[0]
        received = rows.new_empty((total, width))
        back = rows.new_empty((total, width))
        result = rows.new_empty((rows.shape[0], width))
        send, recv = plan.send_splits[0], plan.recv_splits[0]
        dispatch = comm.all_to_all_single(received, rows, group, out_splits=recv, in_splits=send, kind="ep_dispatch",
                                          name=f"{name}.dispatch[{mb}]")
        self.switch()  # A: B's router, shared expert and permute run under this dispatch
        dispatch.wait()
        if total:
            with compute_span(f"{name}.experts[{mb}]"):
                back.index_copy_(0, plan.recv_perm, run(received.index_select(0, plan.recv_perm), plan.groups[0],
                                                        weights))
        combine = comm.all_to_all_single(result, back, group, out_splits=send, in_splits=recv, kind="ep_combine",
                                         name=f"{name}.combine[{mb}]")
        self.switch()  # this combine flies under the other micro-batch's expert GEMMs (A's) or weighted sum (B's)
        combine.wait()
        slots = _slots(plan, result, plan.assignments)
        tokens, k = top_k_index.shape
        return _WeightedSum.apply(slots.view(tokens, k, width), top_k_weights.to(slots.dtype))


def split_sequences(batch: int) -> int:
    """Sequences in micro-batch A: the first half of the batch, rounded up (B gets the rest, maybe none)."""
    return (batch + 1) // 2
