"""MoE decode as two micro-batches (expert_parallel/two_batch.py): `generate()` gives the plain model's tokens.

A transformers MoE model from `parallelize` with its experts over ep runs every forward without
gradients as two micro-batches of sequences whose all-to-alls hide behind each other's compute. Greedy
`generate()` with the KV cache, batched prompts left-padded, each dp rank on prompts of its own (and a
batch size of its own): the tokens equal the plain one-process model's at ep 2 (Qwen2-MoE with its shared
expert, Qwen3-MoE, Mixtral), ep 3 (6 experts), ep 4 and ep 2 x tp 2 (Qwen3-MoE, and Qwen2-MoE with its shared
expert; attention over tp); the logits of one forward equal one
micro-batch's; the router logits the model returns are one entry per layer, as for one batch. Batch 1 on
every rank runs one micro-batch's collectives only; batch 1 beside a peer's batch 2 takes B's turns empty.
From recorded spans: an all-to-all of one micro-batch ran while the other's experts computed.
"""

import copy

import pytest
import torch

from distributed import distributed

pytest.importorskip("transformers")

import hf_moe_cases  # noqa: E402

TOL = 1e-5


def _prompts(seed: int, batch: int, length: int = 5):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 64, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    for b in range(1, batch):  # later prompts shorter: left padding
        pad = min(b, length - 1)
        ids[b, :pad], mask[b, :pad] = 1, 0
    return ids, mask


def _generate(family: str, groups, batch: int, experts: int = 4, plan=None) -> dict:
    import overlapkit
    from overlapkit.models.hf_experts import inference_micro_batches

    ref = hf_moe_cases.build(family, experts=experts, output_router_logits=False).eval()
    kw = {} if plan is None else {"plan": plan}
    model = overlapkit.parallelize(copy.deepcopy(ref), groups.mesh, **kw).eval()
    ids, mask = _prompts(10 + groups.dp_rank, batch)  # tp peers hold the same prompts
    gen = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, use_cache=True, pad_token_id=1,
               synced_gpus=True)  # ranks whose prompts end early keep stepping with their peers
    expected = ref.generate(ids, **gen)
    got = model.generate(ids, **gen)
    with torch.no_grad():
        two = model(input_ids=ids, attention_mask=mask).logits
        inference_micro_batches(model, 1)
        one = model(input_ids=ids, attention_mask=mask).logits
        inference_micro_batches(model, 2)
        plain = ref(input_ids=ids, attention_mask=mask).logits
    with torch.inference_mode():  # micro-batch B's thread runs in inference mode too
        inference = model(input_ids=ids, attention_mask=mask).logits
    return dict(tokens=torch.equal(got, expected), new=got.shape[1] - ids.shape[1],
                inference_mode=bool(torch.equal(inference, two)),
                vs_one=((two - one).abs().max() / one.abs().max()).item(),
                vs_plain=((two - plain).abs().max() / plain.abs().max()).item())


def _router_logits(groups) -> dict:
    """output_router_logits=True: one entry per layer, every token's rows in batch order, as the plain model."""
    import overlapkit

    ref = hf_moe_cases.build("qwen3_moe").eval()
    model = overlapkit.parallelize(copy.deepcopy(ref), groups.mesh).eval()
    ids, mask = _prompts(20 + groups.dp_rank, 3)
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask, output_router_logits=True).router_logits
        want = ref(input_ids=ids, attention_mask=mask, output_router_logits=True).router_logits
    return dict(entries=(len(got), len(want)), err=max((g - w).abs().max().item() for g, w in zip(got, want)))


def _spans_of(groups, batch: int) -> list:
    import overlapkit
    from overlapkit.timeline import record

    model = overlapkit.parallelize(hf_moe_cases.build("mixtral").eval(), groups.mesh).eval()
    ids, _ = _prompts(30, batch)
    with torch.no_grad():
        model(input_ids=ids)
        with record() as rec:
            model(input_ids=ids)
    return sorted({s.name.split(".infer.", 1)[1] for s in rec.spans if ".infer." in s.name})


def _overlap(steps: int = 3) -> list[float]:
    """Per MoE layer and forward: how long micro-batch B's dispatch overlapped A's experts, plus how long A's
    combine overlapped B's experts (ms), from the recorded spans of no-grad forwards (prefill-sized)."""
    import overlapkit
    from overlapkit.timeline import record

    groups = overlapkit.init(ep=2)
    model = overlapkit.parallelize(hf_moe_cases.build("mixtral", hidden_size=256, intermediate_size=512, head_dim=64),
                                   groups.mesh).eval()
    ids = torch.randint(3, 64, (4, 32), generator=torch.Generator().manual_seed(groups.dp_rank))
    with torch.no_grad():
        model(input_ids=ids)
        with record() as rec:
            for _ in range(steps):
                rec.next_step()
                model(input_ids=ids)

    def both(a, b):
        return max(0.0, min(a.end_ms, b.end_ms) - max(a.start_ms, b.start_ms))
    out = []
    for step in range(1, steps + 1):
        spans = {s.name: s for s in rec.spans if s.step == step and ".infer." in s.name}
        for layer in sorted({n.split(".infer.")[0] for n in spans}):
            sp = {n.split(".infer.")[1]: s for n, s in spans.items() if n.startswith(layer + ".infer.")}
            out.append(both(sp["dispatch[1]"], sp["experts[0]"]) + both(sp["combine[0]"], sp["experts[1]"]))
    return out


def _recorder_and_profiler(directory: str) -> dict:
    """Exposed communication per decode step of MoE decode (two micro-batches, ep 2), from the recorder and from
    the torch.profiler trace of the same run (CPU, gloo), read by `overlapkit analyze`'s serving rule."""
    import os

    import torch.distributed as dist

    import overlapkit
    from overlapkit.timeline import record
    from overlapkit.timeline.serving import by_kind, recorded_steps, trace_steps
    from overlapkit.timeline.trace import read_trace

    groups = overlapkit.init(ep=2)
    model = overlapkit.parallelize(hf_moe_cases.build("mixtral", hidden_size=128, intermediate_size=256, head_dim=32,
                                                      output_router_logits=False), groups.mesh).eval()
    ids = torch.randint(3, 64, (4, 8), generator=torch.Generator().manual_seed(groups.dp_rank))
    gen = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=1, synced_gpus=True)
    model.generate(ids, **gen)  # warm-up: first-call agreements
    from torch._C._profiler import _ExperimentalConfig

    # torch's profiler records the threads that started it (and, through their works, gloo's); micro-batch B runs
    # on a thread of its own, seen only with profile_all_threads
    seen = _ExperimentalConfig(profile_all_threads=True)
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, experimental_config=seen) as prof, record() as rec:
        model.generate(ids, **gen)
    path = os.path.join(directory, f"moe_decode_rank{dist.get_rank()}.json")
    prof.export_chrome_trace(path)
    rank = dist.get_rank()
    return dict(recorder=[r.__dict__ for r in by_kind(rank, recorded_steps(rec.spans))],
                trace=[r.__dict__ for r in by_kind(rank, trace_steps(read_trace(path)))])


@distributed(world_size=2, timeout_s=300)
def _recorder_vs_trace(directory: str):
    return _recorder_and_profiler(directory)


def _micro_batches_differ(groups) -> str:
    """One rank set to one micro-batch, its peer to two: both fail, naming it, before any transfer."""
    import torch.distributed as dist

    import overlapkit
    from overlapkit.models.hf_experts import inference_micro_batches
    from overlapkit.runtime.agreement import RankMismatchError

    model = overlapkit.parallelize(hf_moe_cases.build("qwen3_moe").eval(), groups.mesh).eval()
    inference_micro_batches(model, 1 + dist.get_rank())
    try:
        with torch.no_grad():
            model(input_ids=torch.randint(3, 64, (2, 4)))
    except RankMismatchError as e:
        return str(e)
    return "no error"


@distributed(world_size=2, timeout_s=300)
def _ep2():
    import torch.distributed as dist

    import overlapkit

    groups = overlapkit.init(ep=2)
    out = {f: _generate(f, groups, batch=3 if dist.get_rank() == 0 else 2)
           for f in ("qwen2_moe", "qwen3_moe", "mixtral")}
    out["batch1"] = _generate("qwen3_moe", groups, batch=1)
    out["batch1_beside_2"] = _generate("mixtral", groups, batch=1 + dist.get_rank())
    out["router_logits"] = _router_logits(groups)
    out["spans_batch1"] = _spans_of(groups, 1)
    out["spans_batch2"] = _spans_of(groups, 2)
    out["overlap"] = _overlap()
    out["differ"] = _micro_batches_differ(groups)
    return out


@distributed(world_size=3, timeout_s=300)
def _ep3():
    import overlapkit

    return {"qwen3_moe_6_experts": _generate("qwen3_moe", overlapkit.init(ep=3), batch=3, experts=6)}


@distributed(world_size=4, timeout_s=480)
def _world4():
    import overlapkit

    return {"mixtral_ep4": _generate("mixtral", overlapkit.init(ep=4), batch=2),
            "qwen3_moe_ep2_tp2": _generate("qwen3_moe", overlapkit.init(ep=2, tp=2), batch=3),
            "qwen2_moe_ep2_tp2": _generate("qwen2_moe", overlapkit.init(ep=2, tp=2), batch=2)}


def _check(results):
    for rank, r in enumerate(results):
        for case, v in r.items():
            if not isinstance(v, dict) or "tokens" not in v:
                continue
            assert v["tokens"] and 1 <= v["new"] <= 4, (rank, case, v)  # eos may end a rank's prompts early
            assert v["vs_one"] <= TOL and v["vs_plain"] <= TOL and v["inference_mode"], (rank, case, v)


def test_two_micro_batches_generate_the_plain_tokens_at_ep2():
    results = _ep2()
    _check(results)
    for r in results:
        assert r["router_logits"]["entries"] == (2, 2) and r["router_logits"]["err"] <= TOL, r["router_logits"]
        # batch 1 everywhere: micro-batch A's collectives only; batch 2: both micro-batches' transfers and experts
        assert not any(n.endswith("[1]") for n in r["spans_batch1"]), r["spans_batch1"]
        assert {"dispatch[1]", "combine[1]", "experts[1]", "dispatch[0]", "combine[0]"} <= set(r["spans_batch2"])
        # an all-to-all of one micro-batch ran while the other's experts computed, measured from the spans
        assert max(r["overlap"]) > 0, r["overlap"]
        assert "micro_batches differs (rank 0: 1, rank 1: 2)" in r["differ"], r["differ"]


def test_two_micro_batches_at_ep3_ep4_and_ep2_x_tp2():
    _check(_ep3())
    _check(_world4())


def _agree(results) -> str:
    """'' when recorder and trace agree on every rank, else what differs."""
    for r in results:
        rec, trace = ({x["kind"]: x for x in r[k]} for k in ("recorder", "trace"))
        assert set(rec) == set(trace) == {"prefill", "decode"}, r
        assert rec["decode"]["steps"] == trace["decode"]["steps"] == 5 and rec["prefill"]["steps"] == 1, r
        for kind in ("prefill", "decode"):
            a, b = rec[kind], trace[kind]
            # The recorder's transfer ends when its waiting thread wakes (or its watcher sees it done), the trace's
            # when gloo's worker leaves it: every wait of a step adds the scheduler's wake-up latency to the
            # recorder's exposed time, a millisecond a step and more on this loaded 2-core machine, and a prefill is
            # one step. Within that resolution (2 ms, or 40 %) the two agree.
            said = (kind, {k: round(v, 3) for k, v in a.items() if k.endswith("ms")},
                    {k: round(v, 3) for k, v in b.items() if k.endswith("ms")})
            if abs(a["exposed_ms"] - b["exposed_ms"]) > max(2.0, 0.4 * max(a["exposed_ms"], b["exposed_ms"])) \
                    or abs(a["step_ms"] - b["step_ms"]) > max(0.5, 0.1 * a["step_ms"]):
                return repr(said)
    return ""


def test_exposed_comm_per_decode_step_recorder_matches_the_profiler_trace(tmp_path):
    # A window whose ranks were descheduled mid-transfer on the shared 2 cores (the recorder then counts the
    # wait for a peer the trace's gloo worker had not yet started; seen once in a full suite at load 10, 87 vs
    # 7 ms of a prefill) is profiled again, at most three times, as the span-agreement test does.
    misses = []
    for attempt in range(3):
        (tmp_path / str(attempt)).mkdir()
        miss = _agree(_recorder_vs_trace(str(tmp_path / str(attempt))))
        if not miss:
            return
        misses.append(miss)
    raise AssertionError("recorder and trace disagree in every window: " + "; ".join(misses))
