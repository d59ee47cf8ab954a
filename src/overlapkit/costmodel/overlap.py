"""What each overlap technique hides: small schedules run on the stream simulator.

Each function builds the schedule an engine issues — chunks of a TP all-gather feeding GEMM
chunks, a reduce-scatter draining them, DP buckets firing during backward, ZeRO gathers
prefetched one layer ahead — and returns its wall time, so contention and pipeline fill and
drain come out of the schedule instead of a closed form that forgets them.

All times are milliseconds; `contention` is the factor by which compute slows beside a transfer.
"""

from __future__ import annotations

from .simulate import COMPUTE, Task, makespan, simulate


def ring_pieces(chunks: int, tp: int) -> tuple[int, int]:
    """(pieces, local pieces) of a ring exchange split into `chunks` GEMM chunks.

    Each rank's shard is one ring step; with more chunks than ranks every shard is cut further.
    The first `local` pieces are this rank's own and need no transfer.
    """
    if chunks % tp and tp % chunks:
        raise ValueError(f"chunks={chunks} must divide or be a multiple of tp={tp}")
    pieces = max(chunks, tp)
    return pieces, pieces // tp


def ag_gemm_ms(chunk_gemm_ms: float, chunks: int, tp: int, piece_comm_ms: float,
               contention: float, kind: str = "tp_all_gather") -> float:
    """All-gather pipelined into a GEMM: chunk j computes as soon as its pieces landed."""
    pieces, local = ring_pieces(chunks, tp)
    tasks = [Task(f"piece {p}", kind, "comm", piece_comm_ms, contention=contention)
             for p in range(local, pieces)]
    per_chunk = pieces // chunks
    for j in range(chunks):
        last = (j + 1) * per_chunk - 1
        deps = (last - local,) if last >= local else ()
        tasks.append(Task(f"gemm chunk {j}", COMPUTE, "compute", chunk_gemm_ms, deps))
    return makespan(simulate(tasks))


def gemm_rs_ms(chunk_gemm_ms: float, chunks: int, tp: int, piece_comm_ms: float,
               contention: float, kind: str = "tp_reduce_scatter") -> float:
    """A GEMM pipelined into a reduce-scatter: each chunk's partial sums leave as it finishes.

    The chunks destined to other ranks are computed first, this rank's own share last, as in
    a ring reduce-scatter: the last remote transfer can hide behind the own chunk, no more.
    """
    pieces, local = ring_pieces(chunks, tp)
    per_chunk = pieces // chunks
    tasks: list[Task] = []
    for j in range(chunks):
        tasks.append(Task(f"gemm chunk {j}", COMPUTE, "compute", chunk_gemm_ms))
        gemm_idx = len(tasks) - 1
        for p in range(j * per_chunk, (j + 1) * per_chunk):
            if p < pieces - local:
                tasks.append(Task(f"piece {p}", kind, "comm", piece_comm_ms, (gemm_idx,), contention=contention))
    return makespan(simulate(tasks))


def bulk_ms(comm_ms: float, compute_ms: float, contention: float) -> float:
    """A whole collective beside an independent GEMM (issued first, as Megatron does)."""
    tasks = [Task("collective", "comm", "comm", comm_ms, contention=contention),
             Task("independent gemm", COMPUTE, "compute", compute_ms)]
    return makespan(simulate(tasks))


def bucket_sizes(total_bytes: float, bucket_bytes: float) -> list[float]:
    """Bucket sizes in firing order; the last bucket is full and the first holds the remainder.

    The bucket that fires last is the one whose all-reduce cannot be hidden; taking it full
    is the conservative choice (DDP's last bucket holds the first layers' parameters).
    """
    if total_bytes <= 0:
        return []
    full, rem = divmod(total_bytes, bucket_bytes)
    return ([rem] if rem else []) + [bucket_bytes] * int(full)


def buckets_ms(sizes: list[float], hide_ms: float, comm_ms, contention: float) -> float:
    """Backward of `hide_ms` producing gradient buckets that are reduced as soon as full.

    `comm_ms(nbytes)` prices one bucket. Returns the wall time from the start of backward to
    the end of the last bucket's collective: hide_ms + what stayed exposed.
    """
    total = sum(sizes)
    tasks: list[Task] = []
    for i, size in enumerate(sizes):
        tasks.append(Task(f"backward until bucket {i}", COMPUTE, "compute", hide_ms * size / total))
        tasks.append(Task(f"bucket {i}", "comm", "comm", comm_ms(size), (len(tasks) - 1,),
                          contention=contention, nbytes=int(size)))
    return makespan(simulate(tasks)) if tasks else hide_ms


def layered_ms(before: list[float], compute: list[float], after: list[float],
               contention: float, prefetch: int = 1) -> float:
    """Per-layer (or per-chunk) gathers prefetched `prefetch` ahead, compute, then a reduce.

    One comm stream carries both the gathers (needed before layer i) and the reductions
    (after layer i), as FSDP's prefetch and MoE dispatch/combine chunking issue them.
    """
    n = len(compute)
    tasks: list[Task] = []
    gather_idx: dict[int, int] = {}

    def issue_gather(i: int) -> None:
        if i < n and i not in gather_idx and before[i] > 0:
            tasks.append(Task(f"gather {i}", "comm", "comm", before[i], contention=contention))
            gather_idx[i] = len(tasks) - 1

    for i in range(min(prefetch, n)):
        issue_gather(i)
    for i in range(n):
        issue_gather(i + prefetch)
        deps = (gather_idx[i],) if i in gather_idx else ()
        tasks.append(Task(f"compute {i}", COMPUTE, "compute", compute[i], deps))
        if after[i] > 0:
            tasks.append(Task(f"reduce {i}", "comm", "comm", after[i], (len(tasks) - 1,), contention=contention))
    return makespan(simulate(tasks))


CP_SCHEDULES = ("none", "pipelined", "bulk")
"""The context-parallel schedules the ring attention runs (context_parallel.OVERLAPS less auto)."""


def cp_pass_ms(schedule: str, phase: str, block_ms: float, kv_ms: float, dkv_ms: float, blocks: int,
               contention: float) -> float:
    """Wall time of one attention pass (phase fwd or bwd) over `blocks` K/V blocks under a CP schedule, as
    context_parallel runs it: `kv_ms` one K/V hop, `dkv_ms` one fp32 dK/dV hop, `block_ms` one block's attention.

    none: every hop waits for the block before it and the block after waits for it (all in the open).
    pipelined, the ring: a K/V hop forwards the block that just landed, posted as the step before it begins;
    in backward (which keeps step 1's block from forward) the dK/dV accumulator of each block moves on
    after it is attended, and the last hop, home to its owner, has nothing left to hide behind.
    bulk, the all-gather schedule: every K/V hop is posted at the pass's start (one after the other on the
    link), and backward attends the others' blocks first and its own last, sending each dK/dV part straight
    to its owner, so the last part travels behind the own block."""
    if schedule not in CP_SCHEDULES or phase not in ("fwd", "bwd"):
        raise ValueError(f"schedule={schedule!r}, phase={phase!r}: one of {CP_SCHEDULES}, fwd or bwd")
    if schedule == "none":
        kv_hops = blocks - 1 if phase == "fwd" else max(0, blocks - 2)
        return blocks * block_ms + kv_hops * kv_ms + (blocks - 1 if phase == "bwd" else 0) * dkv_ms
    tasks: list[Task] = []

    def add(name: str, duration: float, deps=(), comm: bool = False) -> int:
        deps = tuple(d for d in deps if d is not None)
        tasks.append(Task(name, "cp_kv" if comm else COMPUTE, "comm" if comm else "compute", duration, deps,
                          contention=contention if comm else 1.0))
        return len(tasks) - 1

    first_hop = 1 if phase == "fwd" else 2  # backward attends step 1's block kept from forward
    kv: dict[int, int] = {}
    if schedule == "bulk":
        for i in range(first_hop, blocks):
            kv[i] = add(f"kv {i}", kv_ms, (kv.get(i - 1),), comm=True)
    order = list(range(1, blocks)) + [0] if schedule == "bulk" and phase == "bwd" else list(range(blocks))
    comp: dict[int, int] = {}
    dkv = None
    for step, i in enumerate(order):
        if schedule == "pipelined" and i + 1 >= first_hop and i + 1 < blocks:
            kv[i + 1] = add(f"kv {i + 1}", kv_ms, (kv.get(i), comp.get(i - 1)), comm=True)
        comp[i] = add(f"block {i}", block_ms, (kv.get(i), comp.get(order[step - 1]) if step else None))
        if phase == "bwd" and i != 0:  # the dK/dV of another rank's block goes back towards its owner
            dkv = add(f"dkv {i}", dkv_ms, (comp[i], dkv if schedule == "pipelined" else None), comm=True)
    return makespan(simulate(tasks))
