"""Tensor-parallel RNG: dropout masks that differ across TP ranks where the data differs, and match where it is replicated.

Nothing here overlaps anything. Under tensor/sequence parallelism some activations are the
same on every TP rank (replicated: after an all-reduce) and some are different pieces of one
tensor (sharded: this rank's heads or columns, or under SP this rank's tokens).
- A replicated activation needs the SAME mask on every TP rank, or the replicas drift apart:
  draw it from the default generator, seeded alike on the TP ranks (`check_rng_in_sync`
  says whether it is).
- A sharded activation needs a DIFFERENT mask per rank, or the pieces of one tensor share a
  pattern no unsharded run would have: draw it inside `sharded_rng(tp)`.

`sharded_rng` keeps no state of its own (unlike Megatron's RNG tracker): on entry it draws
one number from the default generator (the same on every TP rank, so the default stream stays
in step) and seeds a forked generator with it plus the TP rank. Activation checkpointing
(torch.utils.checkpoint) restores the default generator before recomputing, so the recompute
draws the same number and the same masks: no tracker to save beside it.
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Iterator

import torch

from ..runtime import comm
from ..runtime.agreement import agree
from ..runtime.groups import resolve_group


@contextlib.contextmanager
def sharded_rng(mesh_or_group) -> Iterator[None]:
    """Random ops inside draw from a generator unique to this TP rank (and to this call)."""
    rank = comm.group_rank(resolve_group(mesh_or_group, "tp"))
    base = int(torch.randint(0, 2**62, (1,)).item())  # advances the default stream alike on every TP rank
    # Only this process's current GPU (one per rank) is forked; CPU always is.
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(base + rank)
        yield


def rng_fingerprint() -> str:
    """A short digest of the default CPU (and current CUDA) generator state."""
    h = hashlib.sha1(torch.get_rng_state().numpy().tobytes())
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        h.update(torch.cuda.get_rng_state().numpy().tobytes())
    return h.hexdigest()[:16]


def check_rng_in_sync(mesh_or_group) -> None:
    """Raise RankMismatchError on every TP rank unless their default generators are in the same state.

    Replicated-region dropout (and `sharded_rng`'s draw) relies on it. Collective over the TP
    group (one store round trip); call it once after seeding, not every step.
    """
    agree(resolve_group(mesh_or_group, "tp"), "tensor-parallel RNG (seed every TP rank alike)",
          default_generator_state=rng_fingerprint())
