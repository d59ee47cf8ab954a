"""For the tests of an `auto` that measures once and keeps (overlapkit.runtime.tuning): steps recorded while any
read of a trial clock fails, to show the decision left nothing timed behind."""

from __future__ import annotations

from overlapkit.runtime import tuning
from overlapkit.timeline import record


def recorded_without_trial_clock(step, steps: int = 3) -> list:
    """Run `step()` `steps` times under the recorder (one recorded step each) while reading a trial clock
    raises; return the recorded spans."""
    def no_clock(*_):
        raise AssertionError("a trial clock was read after the decision")
    real, tuning._stamp = tuning._stamp, no_clock
    try:
        with record() as rec:
            for _ in range(steps):
                rec.next_step()
                step()
    finally:
        tuning._stamp = real
    return rec.spans
