"""Ring attention on gloo ranks vs one process, all from one spawned world of 4 (spawning is the slow part):
cp = 2, 3 (a sub-group of three) and 4; uneven lengths and differing configs fail on every rank; the overlap
seen in recorded spans; a tiny HF Llama with RoPE on each rank's slices; a GPT step with CP=2 x DP=2;
CP=2 x TP=2 with the heads split over TP; the demo's CP=2 x TP=2 (+SP) GPT."""

import torch.distributed as dist

from cp_cases import (TOL, all_attention_cases, auto_overlap, bulk_receives, gpt_cp_dp_errors, llama_errors,
                      recorded_overlap, rejections, tp_heads_errors)
from distributed import distributed
from overlapkit.demos import TOLERANCE, DemoConfig, run_rank
from overlapkit.runtime.groups import ParallelGroups


@distributed(world_size=4, timeout_s=120)
def _world():
    rank = dist.get_rank()
    three = dist.new_group([0, 1, 2])
    cp2 = ParallelGroups.build(cp=2, dp=2).cp  # ranks [0, 1] and [2, 3]
    return dict(cp4=all_attention_cases(dist.group.WORLD), cp3=all_attention_cases(three) if rank < 3 else {},
                cp2=all_attention_cases(cp2), rejections=rejections(cp2),
                pipelined=recorded_overlap(cp2, "pipelined"), sequential=recorded_overlap(cp2, "none"),
                bulk=recorded_overlap(dist.group.WORLD, "bulk"), bulk_receives=bulk_receives(dist.group.WORLD),
                bulk_prefetch1=recorded_overlap(dist.group.WORLD, "bulk", prefetch=1),
                auto=auto_overlap(cp2), auto_bulk=auto_overlap(cp2, "bulk"),
                llama=llama_errors(cp2), gpt=gpt_cp_dp_errors(), tp=tp_heads_errors(),
                demo=run_rank(DemoConfig(tp=2, dp=1, cp=2, steps=2, overlap="none"))["steps"])


_results = None


def results():
    global _results
    if _results is None:
        _results = _world()
    return _results


def test_ring_attention_equals_one_process_cp2_cp3_cp4():
    for r, res in enumerate(results()):
        for cp in ("cp2", "cp3", "cp4"):
            for key, err in res[cp].items():
                assert err <= TOL, f"rank {r} {cp} {key}: rel err {err:.2e}"
    assert len(results()[0]["cp3"]) == len(results()[0]["cp4"]) == 36
    assert sum(" bulk" in k for k in results()[0]["cp3"]) == 16


def test_uneven_sequence_and_differing_configs_fail_on_every_rank():
    for r, res in enumerate(results()):
        msgs = res["rejections"]
        a, b = (0, 1) if r < 2 else (2, 3)  # global ranks of this rank's CP group
        assert "sequence length (dim 2 of a (1, 1, 6, 2) tensor) 6 does not split over cp=2" in msgs["uneven_shard"]
        assert "multiple of 4" in msgs["uneven_shard"], msgs["uneven_shard"]
        assert "local sequence length 3" in msgs["uneven_local"], msgs["uneven_local"]
        assert f"causal differs (rank {a}: True, rank {b}: False)" in msgs["mismatch_causal"], (r, msgs)
        assert f"q differs (rank {a}: [1, 2, 4, 4], rank {b}: [1, 2, 6, 4])" in msgs["mismatch_seq"], (r, msgs)
        assert f"overlap differs (rank {a}: 'bulk', rank {b}: 'pipelined')" in msgs["mismatch_overlap"], (r, msgs)


def test_kv_transfers_hide_behind_block_attention_in_recorded_spans():
    for r, res in enumerate(results()):
        pipe, seq = res["pipelined"], res["sequential"]
        # Forward: 1 K/V hop; backward starts on the block kept from forward, so only the dK/dV hop home.
        assert pipe["count"] == seq["count"] == 2, (pipe, seq)
        assert pipe["names"] == ["cp.attn.bwd.dkv[1]", "cp.attn.fwd.kv[0]"], pipe
        assert pipe["max_hidden_ms"] > 0, f"rank {r}: no cp_kv span overlaps a compute span: {pipe}"
        # The sequential schedule issues each transfer after the block's compute: nothing can hide.
        assert seq["max_hidden_ms"] == 0 and abs(seq["exposed_ms"] - seq["comm_ms"]) < 1e-9, seq


def test_all_gather_schedule_posts_every_block_at_once_and_hides_it_behind_several_blocks():
    for r, res in enumerate(results()):
        bulk = res["bulk"]  # cp = 4: forward's 3 K/V blocks, backward's 2 re-gathered and 3 dK/dV parts
        assert bulk["count"] == 8, bulk
        assert bulk["names"] == sorted([f"cp.attn.fwd.kv[{i}]" for i in (1, 2, 3)] + [f"cp.attn.bwd.kv[{i}]" for i in (2, 3)]
                                       + [f"cp.attn.bwd.dkv[{i}]" for i in (1, 2, 3)]), bulk
        assert bulk["max_hidden_ms"] > 0, f"rank {r}: no cp_kv span overlaps a compute span: {bulk}"
        # Step 3's block was in flight from the start of the pass: beside the attention of steps 0, 1 and 2.
        assert bulk["blocks_beside"]["cp.attn.fwd.kv[3]"] >= 3, bulk
        # prefetch=1: step 3's block is requested only once step 2's is in: beside step 2's attention alone.
        one = res["bulk_prefetch1"]
        assert one["names"] == bulk["names"] and one["blocks_beside"]["cp.attn.fwd.kv[3]"] == 1, one
        # Causal, contiguous: rank r attends the blocks of ranks r−1 … 0 only, and only ranks after it attend its block.
        want = ([f"cp.attn.fwd.kv[{i}]" for i in range(1, r + 1)] + [f"cp.attn.bwd.kv[{i}]" for i in range(2, r + 1)]
                + [f"cp.attn.bwd.dkv[{i}]" for i in range(1, 4 - r)])
        assert res["bulk_receives"] == sorted(want), (r, res["bulk_receives"])


def test_hf_llama_cp2_with_rope_on_slices_equals_one_process():
    for r, res in enumerate(results()):
        assert res["llama"] <= TOL, f"rank {r}: rel err {res['llama']:.2e}"


def test_gpt_steps_cp2_dp2_equal_one_process():
    for r, res in enumerate(results()):
        assert max(res["gpt"]) <= TOL, f"rank {r}: per-step rel err {res['gpt']}"


def test_cp2_tp2_heads_split_over_tp():
    for r, res in enumerate(results()):
        assert res["tp"] <= TOL, f"rank {r}: rel err {res['tp']:.2e}"


def test_demo_cp2_tp2_steps_match_one_process():
    steps = results()[0]["demo"]
    assert len(steps) == 2 and all(s["rel_err"] <= TOLERANCE for s in steps), steps


def test_auto_overlap_keeps_the_slowest_ranks_faster_mode_and_leaves_nothing_running():
    for r, res in enumerate(results()):
        a = res["auto"]
        assert a["decided"] == "pipelined" and "forward+backward" in a["reason"], (r, a)
        deciding, steady, again = a["names"]
        # One all-reduce of the times on the deciding call; afterwards only the ring's own hops.
        assert deciding == sorted(["cp.attn.bwd.dkv[1]", "cp.attn.fwd.kv[0]", "cp.attn overlap.auto"]), deciding
        assert steady == again == ["cp.attn.bwd.dkv[1]", "cp.attn.fwd.kv[0]"], steady
        b = res["auto_bulk"]  # the same, where the slowest rank's times favour the all-gather schedule
        assert b["decided"] == "bulk", (r, b)
        # The all-gather schedule names a block by the step that attends it (fwd.kv[1]), the ring by the step that sends it.
        assert b["names"][1:] == [["cp.attn.bwd.dkv[1]", "cp.attn.fwd.kv[1]"]] * 2, b
