"""Process state that outlives a call, in one registry a test can reset: per-group caches and capability verdicts.

Nothing here overlaps anything. An engine that must remember something between calls (the checks
already made on a group, a group's size, a symmetric-memory workspace, "this cuDNN build refused
that head dim") asks for a named container here once, at import, and keeps using it as a plain
dict or set. `reset()` empties every one in place, so a test starts from a process that has seen
nothing, without knowing which modules keep what. Torch-free.

Per-group entries are keyed by the group (or its name); the k-th cross-rank check of a group on one
rank must meet the k-th on the others, so reset between tests, never while ranks are mid-step.
"""

from __future__ import annotations

from typing import Callable

_GROUP: dict[str, dict | set] = {}
"""Per-group state by name: what a group has been checked for, its size, its buffers."""
_CAPABILITY: dict[str, dict | set] = {}
"""What this process found the hardware or the torch build can or cannot do, by name."""
_CLEARERS: dict[str, Callable[[], None]] = {}
"""Caches kept elsewhere (a functools cache), emptied by a function."""
_PROCESS: dict[str, dict] = {}
"""What this process is wired to while a block runs (the active recorder, a spawned rank's queue to its
parent): set and cleared by the block that owns it, so `reset()` leaves it alone."""


def _container(registry: dict, name: str, kind: type):
    if name in registry:
        if type(registry[name]) is not kind:
            raise TypeError(f"state {name!r} is a {type(registry[name]).__name__}, not a {kind.__name__}")
        return registry[name]
    registry[name] = kind()
    return registry[name]


def cache_dict(name: str) -> dict:
    """The dict called `name` of per-group (or per-device) state: one per name, for the process's life until `reset`."""
    return _container(_GROUP, name, dict)


def cache_set(name: str) -> set:
    """The set called `name` of per-group (or per-device) state."""
    return _container(_GROUP, name, set)


def capability_dict(name: str) -> dict:
    """The dict of capability verdicts called `name` (e.g. device -> whether a fused kernel works)."""
    return _container(_CAPABILITY, name, dict)


def capability_set(name: str) -> set:
    """The set of capability verdicts called `name` (e.g. the (dtype, head dim) a kernel refused)."""
    return _container(_CAPABILITY, name, set)


def process_dict(name: str) -> dict:
    """The dict called `name` of process wiring (an active recorder, a queue): its owner sets and clears it."""
    return _container(_PROCESS, name, dict)


def register_clear(name: str, clear: Callable[[], None]) -> None:
    """Have `reset()` call `clear` too (a functools cache's `cache_clear`)."""
    _CLEARERS[name] = clear


def names() -> dict[str, list[str]]:
    """The registered state, by registry: what `reset()` empties."""
    return {"group": sorted(_GROUP), "capability": sorted(_CAPABILITY), "cleared": sorted(_CLEARERS),
            "process": sorted(_PROCESS)}


def reset() -> None:
    """Forget all per-group state and every capability verdict of this process (between tests)."""
    for container in (*_GROUP.values(), *_CAPABILITY.values()):
        container.clear()
    for clear in _CLEARERS.values():
        clear()
