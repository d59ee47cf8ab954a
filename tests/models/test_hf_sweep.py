"""Every causal-LM family of the installed transformers that ships a base_model_tp_plan: equal to one process, or refused.

One spawned world checks many families in a loop, each from a tiny config (hf_families.build_any:
2 layers, head_dim 8, the size fields of MoE, MLA and state-space configs made small), through
`overlapkit.parallelize(model, mesh)` with nothing else passed (the defaults: auto, SP where the
model allows it). Each family comes out as one of:

- exact: loss and every gradient within 1e-5 of the unsharded model (fp32);
- refused: parallelize or the first forward raised a ValueError/TypeError naming what it cannot do;
- unbuilt: the tiny config does not build or run unsharded under this transformers (said, not tested).

Anything else fails the test naming the family: a wrong number (the worst defect), or a crash
that is not a refusal. docs/plans.md lists the outcomes. The families the older tests pinned
(hf_families.FAMILIES) and Apertus (a learnable activation between up_proj and down_proj) must be
exact. The sweep is cut in parts so that each world stays short; all parts run in the suite.
"""

import copy
import warnings

import pytest
import torch
import torch.distributed as dist

from distributed import distributed

transformers = pytest.importorskip("transformers")

import hf_families  # noqa: E402

MUST_BE_EXACT = (*hf_families.FAMILIES, "apertus")
ODD_TP = ("llama", "apertus", "qwen3", "gemma3_text", "olmo3", "cohere2", "smollm3", "granite", "phi3", "glm4")
"""Families checked at tp 3 as well (6 heads, 3 KV heads)."""
PARTS = 4


def _rel(a, b) -> float:
    # Floor 1e-3: a key projection's bias has a gradient of ~1e-7 (softmax ignores a shift of
    # every key by one vector), whose relative error is rounding noise.
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-3)).item()


def outcome(family: str, mesh) -> tuple[str, str]:
    """(exact | refused | unbuilt | wrong | error, what): this family through parallelize at mesh's size."""
    import overlapkit
    from overlapkit.models import expected_local

    tp = mesh.size()
    try:
        ref = hf_families.build_any(family, tp)
        ids = torch.randint(3, ref.config.vocab_size, (2, 4 * tp), generator=torch.Generator().manual_seed(1))
        r = ref(input_ids=ids, labels=ids)
        r.loss.backward()
    except Exception as e:  # noqa: BLE001 - the family's own code under this transformers, not ours
        return "unbuilt", f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    try:
        model = overlapkit.parallelize(copy.deepcopy(ref), mesh)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
    except (ValueError, TypeError) as e:
        return "refused", str(e).splitlines()[0]
    except Exception as e:  # noqa: BLE001 - reported as a failure naming the family
        return "error", f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    errs = {"loss": abs(out.loss.item() - r.loss.item()) / abs(r.loss.item())}
    for name, local, full in expected_local(model, ref, "grad"):
        errs[name] = float("inf") if (local is None) != (full is None) else _rel(local, full) if full is not None else 0.0
    worst = max(errs, key=errs.get)
    if errs[worst] <= 1e-5:
        return "exact", f"{worst}: {errs[worst]:.2e}"
    # Some families amplify fp32 rounding (Gemma 4: a 512-wide head, attention scale 1; every one of
    # its gradients is off by the same 2e-5, the mark of a rounding difference at the loss carried
    # through, where a wrong rule shows in a few parameters at 1e-2 and more). There the bar is the
    # distance from the same model in fp64: at most 4x the unsharded fp32 model's own (measured:
    # 3x), and docs/plans.md names the family.
    r64 = copy.deepcopy(ref).double()
    for p in r64.parameters():
        p.grad = None
    loss64 = r64(input_ids=ids, labels=ids).loss
    loss64.backward()
    own = {"loss": abs(r.loss.item() - loss64.item()) / abs(loss64.item())}
    ours = {"loss": abs(out.loss.item() - loss64.item()) / abs(loss64.item())}
    for (name, local, full64), (_, _, full32) in zip(expected_local(model, r64, "grad"),
                                                     expected_local(model, ref, "grad")):
        if full64 is not None and local is not None:
            own[name], ours[name] = _rel(full32.double(), full64), _rel(local.double(), full64)
    over = {k: e for k, e in ours.items() if e > max(1e-5, 4 * own[k])}
    k = max(over or ours, key=lambda k: ours[k])
    verdict = "wrong" if over else "exact"
    return verdict, f"{k}: {ours[k]:.2e} from fp64, the unsharded fp32 model's own {own[k]:.2e}"


def _sweep(families) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    return {family: outcome(family, mesh) for family in families}


@distributed(world_size=2, timeout_s=900)
def _tp2(families):
    return _sweep(families)


@distributed(world_size=3, timeout_s=600)
def _tp3(families):
    return _sweep(families)


def _part(i: int) -> list[str]:
    rest = [f for f in hf_families.families_with_a_plan() if f not in MUST_BE_EXACT]
    return list(MUST_BE_EXACT) if i == 0 else rest[i - 1::PARTS - 1]


def _check(per_rank: list[dict]) -> None:
    bad = {}
    for got in per_rank:
        for family, (kind, what) in got.items():
            if kind in ("wrong", "error") or (family in MUST_BE_EXACT and kind != "exact"):
                bad[family] = (kind, what)
    assert not bad, bad
    refusals = [{f: o for f, o in got.items() if o[0] == "refused"} for got in per_rank]
    assert all(r == refusals[0] for r in refusals), "ranks refused differently"


@pytest.mark.parametrize("part", [0, *(pytest.param(i, marks=pytest.mark.slow) for i in range(1, PARTS))])
def test_every_family_with_a_plan_is_exact_or_refused_at_tp2(part):
    _check(_tp2(_part(part)))


def test_families_whose_heads_split_three_ways_are_exact_at_tp3():
    _check(_tp3([f for f in ODD_TP if f in hf_families.families_with_a_plan()]))
