"""Each inference forward as one step of the timeline: a prefill or a decode step, and its exposed communication.

Nothing here overlaps anything; it says how much communication a serving step left exposed. While a
recorder is active, `begin_step("prefill" | "decode")` starts a new step of the recorder and opens a
compute span of that name around the whole forward; the collectives the forward issues land in the
step, and every host wait for them is carved out of the compute span, as for a training step
(runtime/recorder.py). `exposed_per_step(spans)` then reads, per step, the kind of step, its length,
its communication time and the part of it no computation covered. While a torch.profiler runs the
same span is the profiler range `overlapkit.compute.prefill` / `overlapkit.compute.decode`, so a
trace reader can cut a trace into the same steps.
"""

from __future__ import annotations

import contextlib

from ..runtime import recorder
from ..timeline.serving import STEP_KINDS, recorded_steps


def begin_step(kind: str) -> contextlib.ExitStack | None:
    """Open the step of an inference forward (`kind` one of STEP_KINDS); None when nothing records.
    Close it with `end_step` (a forward hook does, whatever the forward raised)."""
    if kind not in STEP_KINDS:
        raise ValueError(f"begin_step: kind={kind!r} is not one of {STEP_KINDS}")
    rec = recorder.active()
    if rec is None and not recorder.profiling():
        return None
    if rec is not None:
        rec.next_step()
    stack = contextlib.ExitStack()
    stack.enter_context(recorder.compute_span(kind))
    return stack


def end_step(stack: contextlib.ExitStack | None) -> None:
    if stack is not None:
        stack.close()


def exposed_per_step(spans) -> list[dict]:
    """Per inference step of one rank's spans: {step, kind, step_ms, comm_ms, exposed_ms, comm_spans}.

    `kind` is the step's compute span name (prefill or decode); a step without one is left out.
    exposed = |union of the step's communication \\ union of its computation| (the report's definition); the
    step runs from its span's start to the later of its end and its work's last end, as `overlapkit analyze`
    cuts a trace's serving steps (timeline/serving.py), so recording and trace are read by one rule.
    """
    return recorded_steps(spans)
