"""DCP checkpoints of the README setup (parallelize + DataParallel + AdamW), compared bit for bit.

Trained two steps at dp=2 x tp=2 and saved with torch's get_state_dict + dcp.save; resumed
with set_state_dict into a fresh model and a fresh optimizer (no step taken) at the same layout,
at tp=4 and at dp=1 x tp=2: every parameter and every Adam moment, gathered whole, is the saved
one exactly. The model part loads into a plain HF model (no "module." prefix, whole tensors).
"""

import copy

import pytest
import torch
import torch.distributed as dist

from distributed import distributed

pytest.importorskip("transformers")

import hf_families  # noqa: E402  (pytest puts this folder on sys.path; spawned ranks inherit it)

EXTRA = dict(num_attention_heads=8, num_key_value_heads=4, hidden_size=64, intermediate_size=128)
"""Sizes that split over tp 2 and 4 alike."""


def _setup(tp: int, dp: int, seed: int):
    import overlapkit
    from overlapkit.data_parallel import DataParallel

    groups = overlapkit.init(tp=tp, dp=dp)
    model = overlapkit.parallelize(hf_families.build("llama", 4, seed=seed, **EXTRA), groups.mesh,
                                   sequence_parallel=True, overlap="pipelined")
    model = DataParallel(model, groups.dp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    return groups, model, opt


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _whole(model, opt) -> dict:
    """Every parameter and Adam moment, gathered whole, by parameter name (collective)."""
    out = {}
    for name, p in model.named_parameters():
        out[f"param/{name}"] = _full(p.detach()).clone()
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{key}/{name}"] = _full(opt.state[p][key]).clone()
    return out


def _resume(directory: str, tp: int, dp: int) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    _, model, opt = _setup(tp, dp, seed=7)  # other weights: a load that does nothing must show
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=directory)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    saved = torch.load(f"{directory}/whole.pt")
    now = _whole(model, opt)
    return {"keys": sorted(set(saved) ^ set(now)),
            "differ": [k for k in saved if k in now and not torch.equal(saved[k], now[k])]}


@distributed(world_size=4, timeout_s=300)
def _save_and_resume_on_four(directory: str):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    groups, model, opt = _setup(tp=2, dp=2, seed=0)
    ids = torch.randint(0, 128, (4, 8), generator=torch.Generator().manual_seed(3))
    mine = ids[2 * groups.dp_rank:2 * groups.dp_rank + 2]
    for _ in range(2):
        opt.zero_grad()
        model(input_ids=mine, labels=mine).loss.backward()
        opt.step()
    whole = _whole(model, opt)
    if dist.get_rank() == 0:
        torch.save(whole, f"{directory}/whole.pt")
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=directory)
    dist.barrier()
    return {"same layout": _resume(directory, tp=2, dp=2), "tp=4": _resume(directory, tp=4, dp=1)}


@distributed(world_size=2, timeout_s=300)
def _resume_on_two(directory: str):
    return {"dp=1 x tp=2": _resume(directory, tp=2, dp=1)}


def test_readme_setup_checkpoint_resumes_bit_equal_at_every_layout_and_loads_into_plain_hf(tmp_path):
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    directory = str(tmp_path)
    for out in _save_and_resume_on_four(directory) + _resume_on_two(directory):
        for layout, res in out.items():
            assert res == {"keys": [], "differ": []}, (layout, res)
    # The model part into a plain HF model: its own state_dict names, whole tensors.
    plain = AutoModelForCausalLM.from_config(hf_families.config("llama", 4, **EXTRA)).float()
    state = {"model": plain.state_dict()}
    dcp.load(state, checkpoint_id=directory, no_dist=True)
    plain.load_state_dict(state["model"])
    saved = torch.load(f"{directory}/whole.pt")
    differ = [n for n, p in plain.named_parameters() if not torch.equal(p.detach(), saved[f"param/module.{n}"])]
    assert differ == []
