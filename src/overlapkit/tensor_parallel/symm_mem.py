"""The "symm_mem" transport of pipelined tensor parallelism: copy-engine pulls from peers' memory under GEMMs.

Every rank publishes its shard (all-gather) or its partial products (reduce-scatter) in a
buffer of PyTorch symmetric memory, which every peer of the node can address directly. A
chunk moves by a plain device copy from the peer's buffer into local memory: the copy engine
does it, so no SM is taken from the GEMMs it overlaps with (NCCL's kernels take some). Pulls
and the GEMMs that consume them alternate between the compute stream and a side stream, so
that the pull of one chunk runs while the GEMM of the previous one does, and two GEMMs may
also overlap each other at the ends of the pipeline. Barriers on the buffer (device-side
signals, two channels for the two streams) say when a peer's data is ready to be pulled and
when a buffer may be written again.

It needs CUDA tensors, an NCCL group whose ranks sit on distinct GPUs of one node with peer
access, and a torch with `torch.distributed._symmetric_memory`. Where any of that is missing,
`check_available` raises `TransportUnavailable` saying which, on every rank alike; it never
falls back to another transport on its own.
"""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist

from ..runtime import comm
from ..runtime import recorder as _rec
from ..runtime import state
from .p2p import Consume, Produce, accum_dtype, side_stream


class TransportUnavailable(RuntimeError):
    """The transport asked for cannot run with these tensors, this group or this torch."""


def _api():
    """The symmetric-memory module, or None with the reason this torch lacks it."""
    try:
        import torch.distributed._symmetric_memory as sm
    except ImportError as e:
        return None, f"torch {torch.__version__} has no torch.distributed._symmetric_memory ({e})"
    missing = [n for n in ("empty", "rendezvous") if not hasattr(sm, n)]
    if missing:
        return None, f"torch {torch.__version__}'s torch.distributed._symmetric_memory lacks {missing}"
    return sm, ""


_verdicts: dict[str, str] = state.capability_dict("symm_mem.usable_per_group")
"""Group name -> '' (usable) or why not, agreed by every rank of the group on first use."""


def _unavailable(reason: str) -> TransportUnavailable:
    return TransportUnavailable(
        f"transport='symm_mem' cannot run here: {reason}. transport='p2p' (batched send/recv) "
        "runs on NCCL and gloo.")


def check_available(group, device: torch.device) -> None:
    """Raise TransportUnavailable, with the reason, where symm_mem cannot run.

    The local reasons (device, backend, torch) are the same on every rank and are raised
    before any communication. Whether the ranks share a node and have peer access is agreed
    once per group with two small object gathers, so every rank raises the same message.
    """
    if device.type != "cuda":
        raise _unavailable(f"the tensors are on {device.type}; symmetric memory is CUDA device memory")
    backend = str(dist.get_backend(group))
    if backend != "nccl":
        raise _unavailable(f"the group's backend is {backend}; symmetric memory rendezvous needs an NCCL group")
    _, reason = _api()
    if reason:
        raise _unavailable(reason)
    ws = comm.group_size(group)
    key = group.group_name
    if ws > 1 and key not in _verdicts:
        _verdicts[key] = _agree_on_peer_access(group, device)
    if _verdicts.get(key):
        raise _unavailable(_verdicts[key])


def _agree_on_peer_access(group, device: torch.device) -> str:
    ws, r = comm.group_size(group), comm.group_rank(group)
    me = (socket.gethostname(), device.index if device.index is not None else torch.cuda.current_device())
    where: list = [None] * ws
    dist.all_gather_object(where, me, group=group)
    hosts = sorted({h for h, _ in where})
    if len(hosts) > 1:
        reason = f"the group spans {len(hosts)} hosts {hosts}; peer memory access is within one node"
    elif len({d for _, d in where}) < ws:
        reason = f"ranks share GPUs (devices by rank: {[d for _, d in where]}); each rank needs its own GPU"
    else:
        blocked = [d for _, d in where if d != me[1] and not torch.cuda.can_device_access_peer(me[1], d)]
        reason = f"rank {r} on cuda:{me[1]} has no peer access to cuda:{blocked}" if blocked else ""
    reasons: list = [None] * ws
    dist.all_gather_object(reasons, reason, group=group)
    return "; ".join(sorted({x for x in reasons if x}))


_workspaces: dict[str, tuple[torch.Tensor, object]] = state.cache_dict("symm_mem.workspaces")


def _workspace(group, nbytes: int, device: torch.device):
    """This group's symmetric buffer (grown when too small: a collective, same size on every rank)."""
    sm, _ = _api()
    key = group.group_name
    buf, handle = _workspaces.get(key, (None, None))
    if buf is None or buf.numel() < nbytes:
        size = max(nbytes, 0 if buf is None else buf.numel())
        buf = sm.empty(size, dtype=torch.uint8, device=device)
        handle = sm.rendezvous(buf, key)
        _workspaces[key] = (buf, handle)
    return handle


def _pull(dst: torch.Tensor, src: torch.Tensor, kind: str, name: str, ws: int) -> None:
    """One copy-engine pull, stamped on the stream it runs on when a recorder is active.

    The profiler range names the copy as a transfer of `kind` in traces, where nothing else
    would tell it from any device-to-device copy.
    """
    rec = _rec.active()
    stamp = rec.comm_issued(kind, name, src.numel() * src.element_size(), ws, stream="copy") if rec else None
    with _rec.comm_range(kind, name):
        dst.copy_(src)
    if stamp is not None:
        rec.comm_done(stamp)


def gather_and_consume(x: torch.Tensor, consume: Consume, k: int, group, *, name: str,
                       need_gathered: bool) -> torch.Tensor | None:
    """All-gather of the 2-D shard `x` by pulls from peers, consuming each chunk as it lands.

    Same contract as `p2p.gather_and_consume`; lane 1 chunks are consumed on the side stream.
    """
    ws, r = comm.group_size(group), comm.group_rank(group)
    R, C = x.shape
    u = R // k
    handle = _workspace(group, x.numel() * x.element_size(), x.device)
    cur, side = torch.cuda.current_stream(x.device), side_stream(x.device)
    gathered = x.new_empty((ws * R, C)) if (ws > 1 or need_gathered) else None
    handle.barrier(channel=0)  # every rank is done with what the buffer held before
    handle.get_buffer(r, (R, C), x.dtype).copy_(x)
    handle.barrier(channel=1)  # every shard is published
    side.wait_stream(cur)
    for j in range(k):
        consume(slice(r * R + j * u, r * R + (j + 1) * u), x[j * u:(j + 1) * u], 0)
    n = 0
    for step in range(1, ws):
        peer = (r + step) % ws
        for j in range(k):
            lane = 1 - n % 2  # the first pull goes to the side stream, beside the local GEMMs
            n += 1
            rows = slice(peer * R + j * u, peer * R + (j + 1) * u)
            with torch.cuda.stream(side if lane else cur):
                remote = handle.get_buffer(peer, (u, C), x.dtype, j * u * C)
                _pull(gathered[rows], remote, "tp_all_gather", f"{name}[{step}.{j}]", ws)
                consume(rows, gathered[rows], lane)
    if need_gathered:
        gathered[r * R:(r + 1) * R].copy_(x)
    cur.wait_stream(side)
    handle.barrier(channel=0)  # no rank overwrites its shard before every peer has pulled it
    return gathered if need_gathered else None


def produce_and_reduce_scatter(produce: Produce, total_rows: int, cols: int, k: int, group, *,
                               dtype: torch.dtype, device: torch.device, name: str) -> torch.Tensor:
    """Reduce-scatter by pulls: each rank pulls the partials its peers computed for its rows.

    Same contract as `p2p.produce_and_reduce_scatter`. Each stream owns one slot of the
    buffer and one barrier channel; a slot is written again only after every peer pulled it.
    """
    ws, r = comm.group_size(group), comm.group_rank(group)
    R = total_rows // ws
    u = R // k
    slot = u * cols
    handle = _workspace(group, 2 * slot * torch.empty((), dtype=dtype).element_size(), device)
    cur, side = torch.cuda.current_stream(device), side_stream(device)
    arrived = torch.empty((ws, R, cols), dtype=dtype, device=device)
    handle.barrier(channel=0)
    side.wait_stream(cur)
    n = 0
    for step in range(1, ws):
        dst, src = (r + step) % ws, (r - step) % ws
        for j in range(k):
            lane = 1 - n % 2
            n += 1
            with torch.cuda.stream(side if lane else cur):
                produce(slice(dst * R + j * u, dst * R + (j + 1) * u),
                        handle.get_buffer(r, (u, cols), dtype, lane * slot))
                handle.barrier(channel=lane)  # every rank's partial for this step is in its slot
                _pull(arrived[step, j * u:(j + 1) * u], handle.get_buffer(src, (u, cols), dtype, lane * slot),
                      "tp_reduce_scatter", f"{name}[{step}.{j}]", ws)
                handle.barrier(channel=lane)  # every peer has pulled this slot: it may be written again
    for j in range(k):
        produce(slice(r * R + j * u, r * R + (j + 1) * u), arrived[0, j * u:(j + 1) * u])
    cur.wait_stream(side)
    handle.barrier(channel=0)
    # One partial needs no sum (and no fp32 round trip).
    return arrived[0] if ws == 1 else arrived.sum(0, dtype=accum_dtype(dtype)).to(dtype)
