"""What one pipeline rank does in one slot of its timetable: a forward (F), an input-gradient or
whole backward (B), a weight-gradient backward (W), or DualPipeV's overlapped pair — the forward of
one micro-batch with the whole backward of another, each one's communication under the other's
compute (pair.py).

Data parallelism inside: a chunk wrapped in `DataParallel` accumulates under `no_sync` except at
its last gradient-producing pass, which launches the buckets as their gradients complete. That pass
is the last micro-batch's backward when it is whole; when it is split, it is that micro-batch's W:
its B then computes the other gradients without accumulating them (they travel in the W store) and
the W hands every gradient of the micro-batch to autograd in one pass, so the buckets are reduced
while the weight-gradient GEMMs run, in the pipeline's cool-down.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

from ..data_parallel import DataParallel
from ..runtime.recorder import compute_span
from .p2p import TickComm
from .schedules import Action, Slot
from .wgrad import WeightGradStore, emit, split_linears


@dataclass
class StepState:
    """What one step carries between its slots."""

    tc: TickComm
    inputs: list | None
    targets: list | None
    shapes: list
    results: dict = field(default_factory=dict)
    """(op, chunk, mb) -> an output or input gradient not yet taken (local) or sent."""
    stash: dict = field(default_factory=dict)
    """(chunk, mb) -> (chunk input, output or loss) kept from F for B."""
    stores: dict = field(default_factory=dict)
    """(chunk, mb) -> the WeightGradStore its F routed the weight-gradient GEMMs to."""
    kept_bytes: int = 0
    peak_kept_bytes: int = 0
    loss_sum: torch.Tensor | None = None
    actions: list = field(default_factory=list)


class SlotActions:
    """The actions of PipelineEngine (a mixin: it reads the engine's chunks, config and schedule)."""

    def _run_slot(self, slot: Slot, tick: int, st: StepState) -> None:
        t0 = time.perf_counter()
        ops = "".join(a.op for a in slot)
        if ops == "F":
            self._forward(slot[0], st)
        elif ops == "B":
            self._backward(slot[0], tick, st, early=True)
        elif ops == "W":
            self._weight(slot[0], st)
        elif ops == "BW":  # a whole backward: its weight gradients in the same pass
            self._backward(slot[0], tick, st, early=True)
        else:  # "FBW": the pair. Its inputs are waited for first, so that only its own work runs inside.
            for a in slot[:2]:
                if st.tc.has(a):
                    st.results[("F", a.chunk - 1, a.mb) if a.op == "F" else ("B", a.chunk + 1, a.mb)] = st.tc.take(a)
            if self.config.overlap_pairs:
                self._pairs.run(lambda: self._forward(slot[0], st), lambda: self._backward(slot[1], tick, st, early=False))
            else:  # one after the other: the reference
                self._forward(slot[0], st)
                self._backward(slot[1], tick, st, early=False)
        t1 = time.perf_counter()
        st.actions += [(a.op, a.mb, a.chunk, t0, t1) for a in slot]

    def _local(self, chunk: int):
        return self.chunks[self._local_of[chunk]]

    def _forward(self, a: Action, st: StepState) -> None:
        chunk = self._local(a.chunk)
        if a.chunk == 0:
            x = st.inputs[a.mb]
        else:
            x = st.tc.take(a) if st.tc.has(a) else st.results.pop(("F", a.chunk - 1, a.mb)).detach()
            if x.is_floating_point():
                x.requires_grad_(True)
        split = (a.chunk, a.mb) in self._split_b
        sync = isinstance(chunk, DataParallel) and not split and a.mb == self._last_backward[a.chunk]
        store = st.stores[(a.chunk, a.mb)] = WeightGradStore(f"pp.W{a.mb}.c{a.chunk}") if split else None
        quiet = chunk.no_sync() if isinstance(chunk, DataParallel) and not sync else contextlib.nullcontext()
        routed = split_linears(self._linear_router[a.chunk], store) if split else contextlib.nullcontext()
        with compute_span(f"pp.F{a.mb}.c{a.chunk}"), quiet, routed:
            out = chunk(x)
            loss = None
            if a.chunk == self.n_chunks - 1:
                loss = self.loss_fn(out, st.targets[a.mb]) / self.config.microbatches
        st.stash[(a.chunk, a.mb)] = (x, loss if loss is not None else out)
        if loss is None:
            self._check_output(a, out, st.shapes)
            st.results[("F", a.chunk, a.mb)] = out
        else:
            st.loss_sum += loss.detach()

    def _check_output(self, a: Action, out: torch.Tensor, shapes: list) -> None:
        """What leaves a chunk must be what the receiver's buffer was made for (shapes learned this step)."""
        want = shapes[a.chunk]
        if (tuple(out.shape), out.dtype) != want:
            raise RuntimeError(f"pipeline chunk {a.chunk} (rank {self.rank}) produced {tuple(out.shape)} {out.dtype} "
                               f"for micro-batch {a.mb}, but the step's shape sweep found {want[0]} {want[1]}: a "
                               "chunk's output must not depend on the data within a step")

    def _backward(self, a: Action, tick: int, st: StepState, *, early: bool) -> None:
        x, out = st.stash.pop((a.chunk, a.mb))
        grad = None
        if a.chunk < self.n_chunks - 1:
            grad = st.tc.take(a) if st.tc.has(a) else st.results.pop(("B", a.chunk + 1, a.mb))
        if a.chunk > 0:
            def send_early(g, a=a):
                # The previous chunk's gradient leaves now, before any end-of-backward wait (DataParallel's).
                st.results[("B", a.chunk, a.mb)] = g
                if early and self.config.overlap == "bulk":
                    st.tc.post(tick, st.results)
            x.register_hook(send_early)
        store = st.stores.get((a.chunk, a.mb))
        chunk = self._local(a.chunk)
        with compute_span(f"pp.B{a.mb}.c{a.chunk}"):
            if store is not None and isinstance(chunk, DataParallel) and a.mb == self._last_backward[a.chunk]:
                self._backward_held(x, out, grad, chunk, store)
            else:
                torch.autograd.backward(out, grad)
        if store is not None:
            store.kept_bytes = store.nbytes  # read once: W gives back what B took (a walk over the store's tensors)
            st.kept_bytes += store.kept_bytes
            st.peak_kept_bytes = max(st.peak_kept_bytes, st.kept_bytes)

    @staticmethod
    def _backward_held(x, out, grad, chunk, store: WeightGradStore) -> None:
        """The last micro-batch's B of a data-parallel chunk: its gradients go into the store, not into
        .grad, so that its W accumulates every gradient of the micro-batch in one (reducing) pass."""
        params = [p for p in chunk.parameters() if p.requires_grad]
        xs = [x] if x.requires_grad else []  # its hook sends the input gradient on
        grads = torch.autograd.grad(out, xs + params, grad, allow_unused=True)
        for p, g in zip(params, grads[len(xs):]):
            if g is not None:
                store.extra[p] = g

    def _weight(self, a: Action, st: StepState) -> None:
        store = st.stores.pop((a.chunk, a.mb))
        st.kept_bytes -= store.kept_bytes
        chunk = self._local(a.chunk)
        final = a.mb == self._last_backward[a.chunk]
        quiet = chunk.no_sync() if isinstance(chunk, DataParallel) and not final else contextlib.nullcontext()
        with compute_span(f"pp.W{a.mb}.c{a.chunk}"), quiet:
            emit(store)
