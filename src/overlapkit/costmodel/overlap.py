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
