"""How long a rank waits for the others: the timeout each process group was created with."""

from __future__ import annotations

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 300.0
"""Timeout of the groups when neither the caller nor the world's group says otherwise."""


def check_timeout(timeout_s) -> float:
    """`timeout_s` as a float, or a ValueError naming it when it is not a finite number of seconds > 0."""
    if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or not timeout_s > 0 \
            or timeout_s == float("inf"):
        raise ValueError(f"timeout_s must be a finite number of seconds > 0, got {timeout_s!r}")
    return float(timeout_s)


def group_timeout_s(group: dist.ProcessGroup | None = None) -> float:
    """The timeout a process group was created with (the world's when `group` is None)."""
    group = group or dist.distributed_c10d._get_default_group()
    for device in (torch.device("cuda"), torch.device("cpu")):
        try:
            return group._get_backend(device).options._timeout.total_seconds()
        except Exception:  # no backend for that device type, or no options on this build
            continue
    return DEFAULT_TIMEOUT_S


def world_timeout_s() -> float:
    """The default group's timeout: what every overlapkit group gets unless told otherwise."""
    return group_timeout_s(None)
