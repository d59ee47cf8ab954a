"""Predicted schedules to simulate and draw: a layer's TP overlap, a step's 1F1B with DP buckets.

`layer_tasks` lays one layer's forward and backward out the way the engines issue them: each
TP collective on the comm stream, each GEMM (or GEMM chunk) on the compute stream, waiting
exactly for the data it needs. `step_tasks` lays a whole step out over pipeline stages (one
lane per stage): 1F1B micro-batches whose durations come from the layer prediction, pipeline
sends/receives, the gradient buckets of the last backward and the optimizer step. Run either
through `simulate.simulate`; `simulate.predicted_spans` gives what the tools layer draws.
"""

from __future__ import annotations

from .collectives import Collectives
from .hardware import Hardware
from .overlap import bucket_sizes, ring_pieces
from .simulate import COMPUTE, Task
from .params import stage_params
from .step import MIB, StepReport, dp_group, grad_reduction, p2p_ms


class _Lane:
    """Issues tasks for one rank, remembering what the next computation must wait for."""

    def __init__(self, tasks: list[Task], rank: int = 0) -> None:
        self.tasks, self.rank, self.waits = tasks, rank, ()

    def put(self, name, kind, stream, ms, deps=(), **kw) -> int:
        self.tasks.append(Task(name, kind, stream, ms, tuple(deps), self.rank, **kw))
        return len(self.tasks) - 1

    def compute(self, name: str, ms: float, deps=()) -> int:
        i = self.put(name, COMPUTE, "compute", ms, tuple(self.waits) + tuple(deps))
        self.waits = ()
        return i


def _site(lane: _Lane, row: dict) -> None:
    kind, comm = row["comm"], dict(contention=row["contention"], nbytes=row["nbytes"], group_size=row["group_size"])
    name, pattern, mode = row["op"], row["pattern"], row["mode"]
    last = (len(lane.tasks) - 1,) if lane.tasks else ()
    if pattern == "exposed":  # only the un-hidden part is known: drawn as a wait on the comm lane
        lane.waits = (lane.put(name, kind, "comm", row["exposed_ms"], last + tuple(lane.waits), **comm),)
    elif mode == "pipelined":
        pieces, local = ring_pieces(row["chunks"], row["group_size"])
        per_chunk = pieces // row["chunks"]
        piece = dict(comm, nbytes=row["nbytes"] // pieces)
        if pattern == "ag_gemm":
            first = len(lane.tasks)
            for p in range(local, pieces):
                lane.put(f"{name} piece {p}", kind, "comm", row["piece_ms"], last + tuple(lane.waits), **piece)
            for j in range(row["chunks"]):
                end = (j + 1) * per_chunk - 1
                lane.compute(f"{name} chunk {j}", row["chunk_ms"], (first + end - local,) if end >= local else ())
        else:
            sent = []
            for j in range(row["chunks"]):
                c = lane.compute(f"{name} chunk {j}", row["chunk_ms"])
                sent += [lane.put(f"{name} piece {p}", kind, "comm", row["piece_ms"], (c,), **piece)
                         for p in range(j * per_chunk, (j + 1) * per_chunk) if p < pieces - local]
            lane.waits = tuple(sent[-1:])
    elif pattern in ("ag_gemm",) or (pattern == "beside" and mode == "none"):
        c = lane.put(f"{name} {kind}", kind, "comm", row["comm_ms"], last + tuple(lane.waits), **comm)
        lane.compute(name, row["gemm_ms"], (c,))
    elif pattern == "beside":  # bulk: the collective runs beside the independent GEMM
        c = lane.put(f"{name} {kind}", kind, "comm", row["comm_ms"], last + tuple(lane.waits), **comm)
        lane.compute(name, row["gemm_ms"])
        lane.waits = (c,)
    else:  # the GEMM's output is reduced before anything uses it
        g = lane.compute(name, row["gemm_ms"])
        lane.waits = (lane.put(f"{name} {kind}", kind, "comm", row["comm_ms"], (g,), **comm),)


def _block(lane: _Lane, rows: list) -> None:
    for row in rows:
        if "comm" in row:
            _site(lane, row)
        else:
            lane.compute(row["op"], row["time_ms"])


def layer_tasks(report: StepReport) -> list[Task]:
    """One layer, forward then backward, one micro-batch, on rank 0."""
    tasks: list[Task] = []
    lane = _Lane(tasks)
    _block(lane, report.layer_fwd.rows)
    _block(lane, report.layer_bwd.rows)
    if lane.waits:
        lane.compute("next layer", 0.0)
    return tasks


def _one_f_one_b(pp: int, m: int, s: int) -> list[tuple[str, int]]:
    """Stage s's order of ('F', j) and ('B', j) under 1F1B."""
    warm = min(pp - s - 1, m)
    order = [("F", j) for j in range(warm)]
    f = warm
    for b in range(m):
        if f < m:
            order.append(("F", f))
            f += 1
        order.append(("B", b))
    return order


def step_tasks(report: StepReport, hw: Hardware, coll: Collectives | None = None) -> list[Task]:
    """A whole step, one lane per pipeline stage (rank = stage).

    Interleaving (vpp) is drawn as vpp times as many micro-batches of 1/vpp the work, which
    gives the same bubble, (pp-1)/vpp micro-batch times. TP and ZeRO communication are inside
    the micro-batch durations (see `layer_tasks` for TP); pipeline transfers and the DP buckets
    of the last backward are drawn as their own tasks.
    """
    par, pp = report.par, report.par.pp
    coll = coll or Collectives(hw)
    p2p = p2p_ms(report.model, par, hw, coll) if pp > 1 else 0.0
    slow = hw.sm_comm_slowdown
    m = par.micro_batches * par.vpp
    per_stage = report.layers_per_stage
    durations = []
    for s in range(pp):
        f = per_stage * report.layer_fwd.wall_ms + (report.head_fwd.wall_ms if s == pp - 1 else 0.0)
        b = per_stage * report.layer_bwd.wall_ms + (report.head_bwd.wall_ms if s == pp - 1 else 0.0)
        durations.append((f / par.vpp, b / par.vpp))
    orders = [_one_f_one_b(pp, m, s) for s in range(pp)]
    tasks: list[Task] = []
    lanes = [_Lane(tasks, s) for s in range(pp)]
    done: dict[tuple[str, int, int], int] = {}
    pos = [0] * pp
    p2p_stream = "compute" if par.overlap.pp == "none" else "p2p"
    while any(pos[s] < len(orders[s]) for s in range(pp)):
        progressed = False
        for s in range(pp):
            while pos[s] < len(orders[s]):
                op, j = orders[s][pos[s]]
                src = (op, s - 1 if op == "F" else s + 1, j)
                needs_peer = (op == "F" and s > 0) or (op == "B" and s < pp - 1)
                if needs_peer and src not in done:
                    break
                deps = []
                if needs_peer:
                    deps.append(lanes[s].put(f"recv {op}{j}", "pp_recv", p2p_stream, p2p, (done[src],),
                                             contention=slow))
                if op == "B" and s == pp - 1:
                    deps.append(done[("F", s, j)])
                last_bwd = op == "B" and j == m - 1
                if last_bwd and par.dp > 1 and par.zero < 3:
                    done[(op, s, j)] = _last_backward(lanes[s], report, durations[s][1], deps, hw, coll)
                else:
                    done[(op, s, j)] = lanes[s].compute(f"{op}{j}", durations[s][0 if op == "F" else 1], deps)
                pos[s] += 1
                progressed = True
        if not progressed:
            raise AssertionError("1F1B order deadlocked")
    for s in range(pp):  # the step needs every gradient reduced
        last = max(i for i, t in enumerate(tasks) if t.rank == s)
        lanes[s].compute("optimizer step", report.step_end_ms + report.optimizer_ms, (last,))
    return tasks


def _last_backward(lane: _Lane, report: StepReport, bwd_ms: float, deps, hw: Hardware, coll: Collectives) -> int:
    """The last backward, cut where gradient buckets fill; buckets reduce as they fill.

    Returns the task that ends the backward computation (what the previous stage waits for).
    """
    par = report.par
    sizes = bucket_sizes(stage_params(report.model, par) / par.tp * par.grad_bytes, par.bucket_mib * MIB)
    kind, collective = grad_reduction(par)
    group = dp_group(par, hw)
    meta = dict(contention=hw.sm_comm_slowdown, group_size=par.dp)
    if par.overlap.dp == "none":  # the whole backward, then every bucket on the compute stream
        end = lane.compute("B last", bwd_ms, deps)
        for i, size in enumerate(sizes):
            lane.put(f"bucket {i}", kind, "compute", coll.time_ms(collective, size, group), (), nbytes=int(size), **meta)
        return end
    total = sum(sizes)
    for i, size in enumerate(sizes):
        end = lane.compute(f"B last until bucket {i}", bwd_ms * size / total, deps if i == 0 else ())
        lane.put(f"bucket {i}", kind, "comm", coll.time_ms(collective, size, group), (end,), nbytes=int(size), **meta)
    return end


# -- what each pipeline schedule costs ------------------------------------------------------------

PIPELINE_SCHEDULES = ("1f1b", "interleaved", "zb1p", "zbv", "dualpipev")
"""The pipeline schedules priced (the engine's, with "interleaved" for interleaved-1f1b)."""


def pipeline_bubble_ms(schedule: str, pp: int, f_ms: float, b_ms: float, w_ms: float, *, vpp: int = 2,
                       hidden_ms: float = 0.0) -> float:
    """Idle time of a rank in one step, for stage durations f (forward), b (input gradient), w (weight
    gradient) of one micro-batch; `vpp` is the interleaved schedule's chunks per rank (zbv and
    dualpipev always hold two); `hidden_ms` what a DualPipeV pair hides of one chunk's communication.

    1F1B: (p-1)(F+B+W); interleaved: that over v; ZB-H1 (Qi et al.): (p-1)(F+B-W), never below the
    warm-up's (p-1)F; ZB-V: its warm-up's (p-1) half-stage forwards, the bubble left at F = B = W
    (with other costs its order adapts but memory bounds it: a lower bound); DualPipeV (DeepSeek):
    (p-1)(F&B + B - 3W) in chunks, F&B = one chunk's F+B+W less what the pair hides. These equal the
    engine's timetable priced with the same durations (tests/pipeline_parallel/test_pp_pricing.py).
    """
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not one of {PIPELINE_SCHEDULES}")
    p = pp - 1
    if schedule == "1f1b":
        return p * (f_ms + b_ms + w_ms)
    if schedule == "interleaved":
        return p * (f_ms + b_ms + w_ms) / vpp
    if schedule == "zb1p":
        return p * max(f_ms, f_ms + b_ms - w_ms)
    if schedule == "zbv":
        return p * f_ms / 2
    f, b, w = f_ms / 2, b_ms / 2, w_ms / 2  # one chunk: half a stage
    return p * max(0.0, (f + b + w - hidden_ms) + (b + w) - 3 * w)


def pipeline_memory(schedule: str, pp: int, vpp: int = 2) -> tuple[float, float]:
    """(activations, kept weight-gradient inputs) at their peak on the rank that holds most, in
    micro-batches of one stage: what the schedule promises.

    Activations: 1F1B, ZB-H1 and ZB-V hold pp (ZB-H1 and ZB-V count a micro-batch until its W, so
    their pending W's are inside the bound), interleaved pp + (pp-1)/v, DualPipeV pp + 1/2. Kept
    W inputs (part of those activations): ZB-H1's last rank postpones pp-1 W's and holds one more
    between its B and W, pp in all; DualPipeV's rank r keeps r+1 chunks', pp/2 stages; ZB-V at most
    its activation bound (an upper bound; its order decides)."""
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not one of {PIPELINE_SCHEDULES}")
    return {"1f1b": (pp, 0.0), "interleaved": (pp + (pp - 1) / vpp, 0.0), "zb1p": (pp, pp),
            "zbv": (pp, pp), "dualpipev": (pp + 0.5, pp / 2)}[schedule]


def _wgrad_inputs(rows: list[dict], elem: int) -> tuple[float, float]:
    """(ms, bytes) of one layer's weight-gradient GEMMs and of what they read (dY and X, m·(k+n) elements);
    a wgrad row without its sizes takes those of the dgrad row of the same GEMM."""
    sizes = {r["op"].rsplit(" ", 1)[0]: r for r in rows if "m" in r}
    ms = nbytes = 0.0
    for r in rows:
        if r["op"].endswith(" wgrad"):
            ms += r["gemm_ms"]
            s = sizes.get(r["op"].rsplit(" ", 1)[0])
            if s is not None:
                nbytes += s["m"] * (s["k"] + s["n"]) * elem
    return ms, nbytes


def price_pipeline_schedules(report) -> list[dict]:
    """Every schedule of PIPELINE_SCHEDULES priced for a StepReport's slowest stage: its bubble (seconds
    and relative to 1F1B's), the stage activations it holds and the GiB its kept W inputs take.

    The stage's one-micro-batch time is split as one layer's is: forward, the weight-gradient GEMMs
    (W, which zero-bubble schedules move) and the rest of backward (B)."""
    par = report.par
    if par.pp < 2:
        return []
    fwd, bwd = report.layer_fwd.wall_ms, report.layer_bwd.wall_ms
    elem = 1 if par.dtype == "fp8" else 2
    w_layer, bytes_layer = _wgrad_inputs(report.layer_bwd.rows, elem)
    stage = max(report.stage_ms) if report.stage_ms else report.layers_per_stage * (fwd + bwd)
    f, w = stage * fwd / (fwd + bwd), stage * w_layer / (fwd + bwd)
    b = stage - f - w
    one = pipeline_bubble_ms("1f1b", par.pp, f, b, w)
    out = []
    for s in PIPELINE_SCHEDULES:
        bubble = pipeline_bubble_ms(s, par.pp, f, b, w, vpp=max(par.vpp, 2))
        acts, kept = pipeline_memory(s, par.pp, max(par.vpp, 2))
        out.append({"schedule": s, "bubble_s": bubble * 1e-3, "bubble_vs_1f1b": bubble / one if one else 0.0,
                    "activations_stage_microbatches": acts,
                    "kept_w_gib": kept * bytes_layer * report.layers_per_stage / 2**30,
                    "f_ms": f, "b_ms": b, "w_ms": w})
    return out
