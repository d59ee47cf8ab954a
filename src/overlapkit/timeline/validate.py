"""What the trace reader refuses rather than guess: times it cannot read and ranks outside their world.

Every number the report gives (communication hidden behind compute, exposed, the step) is a
length of time built from the events' `ts` and `dur`, so an event the reader uses must carry
both as real numbers: not missing, not null, not a boolean (`true` is not 1 µs), finite, `dur`
not negative. "Absurd" is what no profiler trace can hold: an event longer than a day, or
an event more than a day away from the trace's other events (`ts` = 1e18 would make the
step 10^15 ms). A day is far beyond any profiled window (Kineto traces cover seconds to
minutes) and far below a corrupt value's scale, so no real trace sits near the line.

Events the reader does not use (Python frames, user ranges that mark nothing, flows, counters) are
not checked: an odd field there changes no number. Each refusal is one line naming the file, the
event (its index in `traceEvents` and its name) and the field.
"""

from __future__ import annotations

import math
import statistics

DAY_US = 86_400e6
"""A day in the trace's unit (µs): no event lasts this long, no trace spans it."""


class BadTrace(ValueError):
    """An event or a field the reader cannot use; the message names the event and the field."""


def event_label(i: int, e) -> str:
    return f"event {i} ({str(e.get('name', '?'))[:60]!r})" if isinstance(e, dict) else f"event {i}"


def not_an_event(i: int, e) -> BadTrace:
    return BadTrace(f"event {i} is a JSON {_json_type(e)} ({str(e)[:40]!r}), not an event object")


def _json_type(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    return {int: "number", float: "number", str: "string", list: "array"}.get(type(v), type(v).__name__)


def number(i: int, e: dict, key: str) -> float:
    """The `key` field of event i as a float; BadTrace when missing, null, boolean or not a number."""
    if key not in e:
        raise BadTrace(f"{event_label(i, e)} has no {key}")
    value = e[key]
    if value is None or isinstance(value, bool):
        raise BadTrace(f"{event_label(i, e)} has a {_json_type(value)} {key} ({json_text(value)}): "
                       f"a time must be a number")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise BadTrace(f"{event_label(i, e)} has a non-numeric {key}: {str(value)[:40]!r}") from None


def json_text(v) -> str:
    return "null" if v is None else "true" if v is True else "false" if v is False else repr(v)


def check_time(i: int, e: dict, ts: float, dur: float) -> None:
    """BadTrace unless ts is finite and 0 <= dur <= a day."""
    if not -math.inf < ts < math.inf:
        raise BadTrace(f"{event_label(i, e)} has a NaN or infinite ts: a corrupt trace")
    if dur != dur or dur == math.inf:
        raise BadTrace(f"{event_label(i, e)} has a NaN or infinite dur: a corrupt trace")
    if dur < 0:
        raise BadTrace(f"{event_label(i, e)} has a negative dur ({dur:g} µs): a corrupt trace")
    if dur > DAY_US:
        raise BadTrace(f"{event_label(i, e)} has dur {dur:g} µs ({dur / DAY_US:.3g} days): longer than a day, "
                       f"no profiled event is: a corrupt trace")


def check_span(first: tuple, last: tuple, starts: list[float]) -> None:
    """BadTrace when the used events span more than a day: the one farther from the median start is named.

    `first`: (ts, index, event) of the earliest start; `last`: (end, index, event) of the latest end."""
    if not starts or last[0] - first[0] <= DAY_US:
        return
    middle = statistics.median(starts)
    if middle - first[0] >= last[0] - middle:
        ts, i, e = first
        raise BadTrace(f"{event_label(i, e)} has ts {ts:g} µs, {(middle - ts) / DAY_US:.3g} days before the "
                       f"trace's other events: a corrupt trace")
    end, i, e = last
    ts = float(e.get("ts", end))
    field, value = ("ts", ts) if ts - middle > DAY_US else ("dur", end - ts)
    raise BadTrace(f"{event_label(i, e)} has {field} {value:g} µs, ending {(end - middle) / DAY_US:.3g} days after "
                   f"the trace's other events: a corrupt trace")


def check_rank(rank, world) -> str | None:
    """The problem with a trace's `distributedInfo` rank and world size, or None. A world of 0 or a rank
    outside it would put spans on a rank no job has."""
    if world is not None and (isinstance(world, bool) or not isinstance(world, int) or world < 1):
        return f"distributedInfo.world_size is {json_text(world)}: a world size is an integer >= 1"
    if isinstance(rank, int) and not isinstance(rank, bool) and world is not None and rank >= world:
        return f"rank {rank} is outside the world of {world} ranks (ranks 0..{world - 1})"
    return None
