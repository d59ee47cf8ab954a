"""The spans of a GPU trace: one per kernel, memcpy and memset, on its stream, tied to its launch.

What was open on the launching thread at launch time decides what a GPU event is
(`timeline/kinds.py`): an `overlapkit.comm.<kind>` range makes it that transfer (copies too:
copy-engine transfers count); an NCCL/RCCL kernel is its collective, named and sized from its
own args, the `record_param_comms` op with its External id, or the one around its launch
(`timeline/messages.py`); DeepEP, userbuffers, symmetric-memory and NVSHMEM kernels are the
transfers their names say; a collective FSDP2 issued inside its ranges takes the ZeRO-3 kind
(`timeline/fsdp2.py`). Kernels a CUDA graph replays share the graph launch's correlation id,
so they are tied to that launch (and named as the graph's in the critical path).
"""

from __future__ import annotations

from .fsdp2 import fsdp2_comm
from .kinds import collective_kind, copy_comm_kind, is_nccl, kernel_comm_kind, nccl_kind_from_name, range_label
from .messages import keep, message
from ..runtime.spans import COMPUTE, Span


def gpu_spans(gpu, launches, ranges, param_comms, param_by_ext, markers, fsdp) -> list[tuple]:
    """(launch time, span in raw µs, has a launch, (thread, launch time, launch name) or None) per GPU event."""
    devices = {a.get("device") for _, _, _, _, a in gpu}
    out = []
    for what, name, start, end, args in gpu:
        launch = launches.get(args.get("correlation"))
        issued = launch[1] if launch else start
        stream = f"stream {args.get('stream', '?')}"
        if len(devices) > 1:
            stream = f"gpu {args.get('device')} {stream}"
        rng = ranges.find(launch[0], launch[1]) if launch else None
        label = range_label(rng["name"]) if rng else (None, None)
        kind, span_name, nbytes, group, pg = COMPUTE, name, 0, 0, ""
        if what != "kernel":
            kind, nbytes = copy_comm_kind(name) or what, int(args.get("bytes", 0) or 0)
        elif is_nccl(name):
            kind, nbytes, group, pg = nccl_kind(name, args, launch, param_comms, param_by_ext)
        elif (other := kernel_comm_kind(name)) is not None:
            kind = other
        elif label[0] == "compute":
            span_name = label[1]
        if kind != COMPUTE and launch and (chain := fsdp.enclosing(launch[0], launch[1])):
            # FSDP2's collective (not its copy-in/out kernels): its ZeRO-3 kind, named by module.
            got = fsdp2_comm([r["name"] for r in chain], kind.removeprefix("zero_"))
            if got is not None:
                kind, span_name = got
        if label[0] == "comm":
            kind = label[1]  # our own range names the transfer, whatever ran it
        marked = markers.find(launch[0], launch[1]) if launch else None
        out.append((issued, Span(kind=kind, name=span_name, stream=stream, start_ms=start, end_ms=end,
                                 nbytes=nbytes, group_size=group, group=pg,
                                 phase=marked["phase"] if marked else None), launch is not None,
                    launch))
    return out


def nccl_kind(name, args, launch, param_comms, param_by_ext) -> tuple[str, int, int, str]:
    """(collective, message bytes, group size, process group) of an NCCL kernel."""
    meta = args if "Collective name" in args else param_by_ext.get(args.get("External id"))
    if (meta is None or "Collective name" not in meta) and launch:
        around = param_comms.find(launch[0], launch[1])
        if around is not None and ("Collective name" in around or meta is None):
            meta = around
    if meta is None:
        return nccl_kind_from_name(name), 0, 0, ""
    nbytes, group, pg = message(meta)
    kind = collective_kind(str(meta["Collective name"])) if "Collective name" in meta else nccl_kind_from_name(name)
    return kind, nbytes, group, pg


_GPU_ARGS = ("correlation", "stream", "device", "bytes", "External id")


def keep_gpu(args: dict) -> dict:
    """What the reader needs of a GPU event's args (a kernel's carry a dozen more fields)."""
    out = {k: args[k] for k in _GPU_ARGS if k in args}
    if "Collective name" in args:
        out.update(keep(args))
    return out
