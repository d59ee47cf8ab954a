"""DCP checkpoints of the README setup (parallelize + DataParallel + AdamW, and its ShardedOptimizer and
fully_shard forms), compared bit for bit.

Trained two steps at dp=2 x tp=2 and saved with torch.distributed.checkpoint; resumed into a
fresh model and a fresh optimizer (no step taken) at the same layout, at tp=4 and at dp=1 x tp=2:
every parameter and every Adam moment, gathered whole, is the saved one exactly. DataParallel
and fully_shard go through torch's get_state_dict / set_state_dict; ShardedOptimizer through its
`checkpoint_state_dict`. The DataParallel's model part loads into a plain HF model (its own
state_dict names, whole tensors).
"""

import pytest
import torch
import torch.distributed as dist

from distributed import distributed

pytest.importorskip("transformers")

import hf_families  # noqa: E402  (pytest puts this folder on sys.path; spawned ranks inherit it)

EXTRA = dict(num_attention_heads=8, num_key_value_heads=4, hidden_size=64, intermediate_size=128)
"""Sizes that split over tp 2 and 4 alike."""

KINDS = ("DataParallel", "ShardedOptimizer", "fully_shard")
OPT = dict(lr=1e-2, weight_decay=0.1)


def _setup(kind: str, tp: int, dp: int, seed: int):
    import overlapkit
    from overlapkit.data_parallel import DataParallel, ShardedOptimizer, fully_shard

    groups = overlapkit.init(tp=tp, dp=dp)
    model = overlapkit.parallelize(hf_families.build("llama", 4, seed=seed, **EXTRA), groups.mesh,
                                   sequence_parallel=True, overlap="pipelined")
    if kind == "fully_shard":
        model = fully_shard(model, groups)
        return groups, model, torch.optim.AdamW(model.parameters(), foreach=True, **OPT)
    model = DataParallel(model, groups.dp)
    if kind == "ShardedOptimizer":
        return groups, model, ShardedOptimizer(model, torch.optim.AdamW, groups.dp, **OPT)
    return groups, model, torch.optim.AdamW(model.parameters(), foreach=True, **OPT)


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _state(kind: str, model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    if kind == "ShardedOptimizer":
        return {"model": model.state_dict(), "optim": opt.checkpoint_state_dict()}
    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd}


def _whole(state: dict) -> dict:
    """Every parameter and Adam moment of a checkpoint state, gathered whole (collective)."""
    out = {f"param/{k}": _full(v).detach().clone() for k, v in state["model"].items()}
    for fqn, st in state["optim"]["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{key}/{fqn}"] = _full(st[key]).clone()
    return out


def _resume(kind: str, directory: str, tp: int, dp: int) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    _, model, opt = _setup(kind, tp, dp, seed=7)  # other weights: a load that does nothing must show
    state = _state(kind, model, opt)
    dcp.load(state, checkpoint_id=f"{directory}/{kind}")
    if kind == "ShardedOptimizer":
        model.load_state_dict(state["model"])
        opt.load_checkpoint_state_dict(state["optim"])
    else:
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    saved = torch.load(f"{directory}/{kind}.whole.pt")
    now = _whole(_state(kind, model, opt))
    return {"keys": sorted(set(saved) ^ set(now)),
            "differ": [k for k in saved if k in now and not torch.equal(saved[k], now[k])]}


@distributed(world_size=4, timeout_s=400)
def _save_and_resume_on_four(directory: str):
    import torch.distributed.checkpoint as dcp

    out = {}
    for kind in KINDS:
        groups, model, opt = _setup(kind, tp=2, dp=2, seed=0)
        ids = torch.randint(0, 128, (4, 8), generator=torch.Generator().manual_seed(3))
        mine = ids[2 * groups.dp_rank:2 * groups.dp_rank + 2]
        for _ in range(2):
            opt.zero_grad() if kind != "ShardedOptimizer" else model.zero_grad()
            model(input_ids=mine, labels=mine).loss.backward()
            opt.step()
        state = _state(kind, model, opt)
        whole = _whole(state)
        if dist.get_rank() == 0:
            torch.save(whole, f"{directory}/{kind}.whole.pt")
        dcp.save(state, checkpoint_id=f"{directory}/{kind}")
        dist.barrier()
        out[(kind, "same layout")] = _resume(kind, directory, tp=2, dp=2)
        out[(kind, "tp=4")] = _resume(kind, directory, tp=4, dp=1)
    return out


@distributed(world_size=2, timeout_s=300)
def _resume_on_two(directory: str):
    return {(kind, "dp=1 x tp=2"): _resume(kind, directory, tp=2, dp=1) for kind in KINDS}


def test_readme_setup_checkpoint_resumes_bit_equal_at_every_layout_and_loads_into_plain_hf(tmp_path):
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    directory = str(tmp_path)
    for out in _save_and_resume_on_four(directory) + _resume_on_two(directory):
        for case, res in out.items():
            assert res == {"keys": [], "differ": []}, (case, res)
    # The model part into a plain HF model: its own state_dict names, whole tensors.
    plain = AutoModelForCausalLM.from_config(hf_families.config("llama", 4, **EXTRA)).float()
    state = {"model": plain.state_dict()}
    dcp.load(state, checkpoint_id=f"{directory}/DataParallel", no_dist=True)
    plain.load_state_dict(state["model"])
    saved = torch.load(f"{directory}/DataParallel.whole.pt")
    differ = [n for n, p in plain.named_parameters() if not torch.equal(p.detach(), saved[f"param/{n}"])]
    assert differ == []
