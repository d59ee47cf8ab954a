"""One probe run as every rank of a torchrun job: `python -m torch.distributed.run ... torchrun_probe.py CASE`.

Each rank prints one line `[probe rank R] <outcome>` (in one write, a newline before and after) (the error's class and first line, or `ok <loss>`)
so the test reads what every rank heard from torchrun's output.
"""

import sys

import torch
from torch import nn

import overlapkit
from overlapkit.runtime.agreement import RankMismatchError


def main(case: str) -> None:
    groups = overlapkit.init(tp=2 if case == "tp_shorter" else 1, timeout_s=3.0)
    import torch.distributed as dist
    rank = dist.get_rank()
    try:
        if case == "tp_shorter":
            from overlapkit.models import GPT, GPTConfig, parallelize
            from overlapkit.models.gpt import lm_loss
            torch.manual_seed(0)
            model = parallelize(GPT(GPTConfig()), groups.mesh, overlap="none")
            ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(5))
            if rank == 1:
                ids = ids[:, :8]
            out = lm_loss(model(ids), ids).item()
        else:  # dp_skip_backward: rank 1 skips backward in its first step
            from overlapkit.data_parallel import DataParallel
            torch.manual_seed(0)
            net = DataParallel(nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)), groups.dp)
            opt = torch.optim.SGD(net.parameters(), lr=0.1)
            for step in range(3):
                loss = net(torch.randn(4, 5)).square().mean()
                if not (rank == 1 and step == 0):
                    loss.backward()
                opt.step()
                opt.zero_grad()
            out = loss.item()
        print(f"\n[probe rank {rank}] ok {out}\n", end="", flush=True)
    except RankMismatchError as e:
        print(f"\n[probe rank {rank}] RankMismatchError {str(e).splitlines()[0]}\n", end="", flush=True)
        sys.exit(3)


if __name__ == "__main__":
    main(sys.argv[1])
