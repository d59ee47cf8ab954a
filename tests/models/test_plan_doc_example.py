"""docs/plans.md's hand-written plan, run as written on a model without a tp_plan (StableLM), equals one process.

The code block is read from the doc itself, so the doc cannot drift from what works. StableLM's
attention reshapes by `self.num_heads`: `parallelize` sets each attention's head counts to this
rank's (plans.set_local_heads), which the user used to have to do by hand.
"""

import copy
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from distributed import distributed

pytest.importorskip("transformers")

DOC = Path(__file__).resolve().parents[2] / "docs" / "plans.md"


def doc_example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    return next(b for b in blocks if "plan = {" in b and "model.layers.*.self_attn.o_proj" in b)


@distributed(world_size=2, timeout_s=120)
def _run():
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoConfig, AutoModelForCausalLM

    import overlapkit
    from overlapkit.models import expected_local

    tp = dist.get_world_size()
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "stablelm", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, attn_implementation="eager")).float()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    scope = {"overlapkit": overlapkit, "model": copy.deepcopy(ref), "ids": ids,
             "mesh": init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))}
    exec(doc_example(), scope)  # noqa: S102 - the doc's own code, as a user would paste it
    scope["loss"].backward()
    logits = ref(ids).logits
    r = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 64), ids[:, 1:].reshape(-1))
    r.backward()
    errs = {"loss": abs(scope["loss"].item() - r.item()) / r.item()}
    for name, local, full in expected_local(scope["model"], ref, "grad"):
        errs[name] = ((local - full).norm() / full.norm().clamp_min(1e-3)).item()
    return errs


def test_the_docs_hand_written_plan_runs_as_written_on_stablelm():
    for errs in _run():
        assert len(errs) > 20 and max(errs.values()) <= 1e-5, errs
