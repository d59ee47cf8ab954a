"""The README's two composed examples, run as written: a MoE model at dp x ep x tp and a dense one at pp x tp x dp.

Each block is taken from README.md and executed on the ranks its `overlapkit.init` asks for, with the
names it expects from the page (`idx`, `cfg`, `batches`) supplied; its first loss is compared with one
process running the same model on the same tokens (fp32, rel <= 1e-5).
"""

import re
from pathlib import Path

import pytest
import torch

from distributed import distributed

pytest.importorskip("transformers")

README = Path(__file__).resolve().parents[1] / "README.md"


def _block(marker: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    found = [b for b in blocks if marker in b]
    assert len(found) == 1, f"one README python block with {marker!r}, found {len(found)}"
    return found[0]


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@distributed(world_size=4, timeout_s=300)
def _moe():
    import overlapkit

    ids = torch.randint(3, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    scope: dict = {}
    scope["idx"] = None  # set once the block's init has run: this dp rank's half of the batch
    code = _block("overlapkit.init(ep=2, tp=2)")
    head, rest = code.split("torch.manual_seed(0)", 1)
    exec(compile(head, "README.md", "exec"), scope)
    scope["idx"] = ids.chunk(2)[scope["groups"].dp_rank]
    exec(compile("torch.manual_seed(0)" + rest, "README.md", "exec"), scope)
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(0)
    ref = Qwen3MoeForCausalLM(scope["cfg"])
    want = ref(input_ids=scope["idx"], labels=scope["idx"]).loss.item()
    experts = [p for p in scope["model"].parameters() if getattr(p, "expert_parallel", False)]
    return {"loss": _rel(scope["loss"].item(), want), "experts held": experts[0].to_local().shape[0]}


@distributed(world_size=8, timeout_s=480)
def _dense():
    from transformers import LlamaConfig, LlamaForCausalLM

    import overlapkit

    first = _block("overlapkit.init(tp=2, dp=2)")  # the README's cfg, from its first example
    cfg = eval(re.search(r"^cfg = (LlamaConfig\(.*\))$", first, re.M).group(1), {"LlamaConfig": LlamaConfig})
    batch = torch.randint(0, 64, (8, 8), generator=torch.Generator().manual_seed(2))
    scope = {"torch": torch, "overlapkit": overlapkit, "LlamaForCausalLM": LlamaForCausalLM, "cfg": cfg,
             "batches": [batch]}
    exec(compile(_block("overlapkit.init(pp=2, tp=2, dp=2)"), "README.md", "exec"), scope)
    torch.manual_seed(0)
    want = LlamaForCausalLM(cfg)(input_ids=batch, labels=batch).loss.item()  # each dp rank was fed this batch
    return {"loss": _rel(scope["loss"].item(), want)}


def test_readme_moe_at_dp_ep_tp_runs_and_its_loss_is_one_process():
    for out in _moe():
        assert out["loss"] <= 1e-5, out
        assert out["experts held"] == 4, out  # 8 experts over ep 2


def test_readme_dense_at_pp_tp_dp_runs_and_its_loss_is_one_process():
    for out in _dense():
        assert out["loss"] <= 1e-5, out
