"""ZeRO-3 / FSDP prefetch: how far ahead to issue a layer's parameter all-gather so that it
hides behind the compute of the layers before it, within a memory budget.

Each prefetched layer holds its unsharded parameters before they are used, so depth d costs
d extra layers of parameters; depth 0 gathers each layer when it is needed (nothing hides).
The wall time of every depth is priced on the stream simulator (`layered_ms`: one
communication stream carrying the gathers and, in backward, the reduce-scatters in issue
order), and the shallowest depth within `MIN_GAIN` of the fastest affordable one is chosen.
"""

from __future__ import annotations

from . import _validate as v
from .simulate import COMPUTE, Task, makespan, simulate

MIN_GAIN = 0.01
"""A deeper prefetch must save more than this share of the wall time to be worth its memory."""


def prefetch_wall_ms(layer_compute_ms: float, gather_ms: float, depth: int, *, num_layers: int = 8,
                     reduce_ms: float = 0.0, contention: float = 1.0) -> float:
    """Wall time of `num_layers` layers whose gathers are issued `depth` layers ahead.

    Layer j's gather is issued when layer j - depth starts (after compute j - depth - 1), as
    FSDP2's explicit prefetch does from a layer's pre-hook; depth 0 gathers a layer only once
    the previous one is done. Gathers and reduce-scatters share one communicator, hence one
    stream, in issue order.
    """
    tasks: list[Task] = []
    compute_idx: list[int] = []
    gather_idx: dict[int, int] = {}

    def issue_gather(j: int) -> None:
        if j < num_layers and j not in gather_idx:
            after = j - depth - 1
            deps = (compute_idx[after],) if after >= 0 else ()
            tasks.append(Task(f"gather {j}", "zero_all_gather", "comm", gather_ms, deps, contention=contention))
            gather_idx[j] = len(tasks) - 1

    for j in range(min(depth, num_layers)):
        issue_gather(j)
    for i in range(num_layers):
        for j in range(i, i + depth + 1):
            issue_gather(j)
        tasks.append(Task(f"layer {i}", COMPUTE, "compute", layer_compute_ms, (gather_idx[i],)))
        compute_idx.append(len(tasks) - 1)
        if reduce_ms > 0:
            tasks.append(Task(f"reduce-scatter {i}", "zero_reduce_scatter", "comm", reduce_ms, (compute_idx[i],),
                              contention=contention))
    return makespan(simulate(tasks))


def fsdp_prefetch_choice(layer_compute_ms: float, gather_ms: float, param_bytes_per_layer: float,
                         memory_budget_bytes: float | None = None, *, num_layers: int = 8,
                         reduce_ms: float = 0.0, max_depth: int = 4,
                         contention: float = 1.0) -> tuple[int, str]:
    """(prefetch depth, one-line reason) for FSDP's `prefetch="auto"`.

    layer_compute_ms: one wrapped unit's compute (forward, or backward: then pass `reduce_ms`,
    its gradient reduce-scatter, which shares the communication stream); gather_ms: its
    parameter all-gather; param_bytes_per_layer: its unsharded parameter bytes;
    memory_budget_bytes: bytes allowed for parameters gathered ahead (None: no limit);
    contention: compute slowdown beside a transfer (NCCL takes SMs; H200 ~1.1).
    """
    o = "fsdp_prefetch_choice"
    for name, x in (("layer_compute_ms", layer_compute_ms), ("gather_ms", gather_ms),
                    ("param_bytes_per_layer", param_bytes_per_layer), ("reduce_ms", reduce_ms)):
        v.finite(o, name, x, allow_zero=True)
    if memory_budget_bytes is not None:
        v.finite(o, "memory_budget_bytes", memory_budget_bytes, allow_zero=True)
    v.positive_int(o, "num_layers", num_layers)
    v.positive_int(o, "max_depth", max_depth)
    if not 1.0 <= contention <= 3.0:
        raise v.ConfigError(f"{o}.contention={contention!r}: must be in [1, 3]")
    if gather_ms == 0:
        return 0, "no gather time: nothing to hide"
    afford = max_depth
    if memory_budget_bytes is not None and param_bytes_per_layer > 0:
        afford = min(max_depth, int(memory_budget_bytes // param_bytes_per_layer), num_layers)
    if afford == 0:
        return 0, (f"memory budget {memory_budget_bytes:.3g} B holds no prefetched layer "
                   f"({param_bytes_per_layer:.3g} B each): gathers stay exposed")
    walls = {d: prefetch_wall_ms(layer_compute_ms, gather_ms, d, num_layers=num_layers, reduce_ms=reduce_ms,
                                 contention=contention) for d in range(afford + 1)}
    best = min(walls.values())
    depth = next(d for d in sorted(walls) if walls[d] <= best * (1 + MIN_GAIN))
    compute = num_layers * layer_compute_ms
    exposed = max(0.0, walls[depth] - compute)
    comm = num_layers * (gather_ms + reduce_ms)
    why = ("communication longer than compute: it cannot all hide" if comm > compute * contention
           else "gathers fit under the compute")
    limit = f", memory allows {afford}" if afford < max_depth else ""
    return depth, (f"depth {depth}: {exposed:.3g} ms of {comm:.3g} ms communication exposed over "
                   f"{num_layers} layers of {layer_compute_ms:.3g} ms ({why}; deeper saves < "
                   f"{100 * MIN_GAIN:.0f}%{limit})")

