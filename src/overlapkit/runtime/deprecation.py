"""Old spellings of a setting keep working: each warns once per process and maps to its new name.

Nothing here overlaps anything. Every engine says "how much to overlap" with `overlap=` (the modes of
vocabulary.OVERLAP_MEANING), its depth knobs in depth-named fields; the names that came before stay
accepted so that a user's script runs unchanged while it learns the new ones.
"""

from __future__ import annotations

import warnings

from . import state

_WARNED = state.cache_set("deprecation.warned")
"""The old spellings already warned about (`state.reset()` forgets them, so a test sees the warning)."""


def deprecated(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Warn, once per process, that `old` is spelled `new` now (a DeprecationWarning at the caller's caller)."""
    if old in _WARNED:
        return
    _WARNED.add(old)
    warnings.warn(f"{old} is deprecated: use {new} (same behaviour)", DeprecationWarning, stacklevel=stacklevel)
