"""Train a tiny Llama with Hugging Face's Trainer on overlapkit's engines: tp 2 x dp 2 on 4 CPU ranks.

    python examples/trainer_tp_dp.py                  # starts 4 local gloo ranks itself
    torchrun --nproc-per-node 4 examples/trainer_tp_dp.py      # the same under torchrun (CUDA: NCCL)

Every rank builds the same model, `overlapkit.parallelize` keeps its tensor-parallel shard (the
output head split over the vocabulary, so `labels=` uses the vocabulary-parallel loss), and
`OverlapTrainer` does the rest the Trainer way: overlapkit's gradient buckets instead of DDP, each
dp rank its own batches, a checkpoint every 10 steps (DCP: resumable at another tp x dp), an
evaluation, the overlap report (exposed communication per kind) logged beside the loss, and a
final `save_model` that a plain `LlamaForCausalLM.from_pretrained` loads.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch

TP, DP = 2, 2


class Tokens(torch.utils.data.Dataset):
    """Random token sequences: a stand-in for your tokenized dataset."""

    def __init__(self, n: int, seq: int = 32, vocab: int = 128, seed: int = 0):
        self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def train(out: str) -> None:
    import overlapkit
    from overlapkit.integrations import OverlapTrainer
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

    groups = overlapkit.init(tp=TP, dp=DP)  # the world laid out as dp x tp; torch.distributed set up if needed
    torch.manual_seed(0)  # every rank builds the same model, then keeps its shard
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    model = overlapkit.parallelize(LlamaForCausalLM(cfg), groups.mesh, overlap="auto")
    args = TrainingArguments(output_dir=out, max_steps=20, per_device_train_batch_size=4, learning_rate=3e-3,
                             gradient_accumulation_steps=2, max_grad_norm=1.0, lr_scheduler_type="cosine",
                             logging_steps=5, save_steps=10, eval_strategy="steps", eval_steps=10,
                             report_to=[], use_cpu=not torch.cuda.is_available(), disable_tqdm=True)
    trainer = OverlapTrainer(model=model, args=args, groups=groups, train_dataset=Tokens(640),
                             eval_dataset=Tokens(20, seed=1))
    trainer.train()
    trainer.save_model(f"{out}/final")
    if groups.rank == 0:
        plain = LlamaForCausalLM.from_pretrained(f"{out}/final")
        print(f"saved to {out}/final; a plain model loads it: {sum(p.numel() for p in plain.parameters())} parameters")
        print("checkpoints (DCP inside, resumable at another tp x dp):",
              sorted(d for d in os.listdir(out) if d.startswith("checkpoint-")))


def _rank(out: str) -> None:
    train(out)


def main() -> int:
    out = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="overlapkit_trainer_")
    if "RANK" in os.environ:  # under torchrun
        train(out)
        return 0
    from overlapkit.launch import spawn

    spawn(_rank, TP * DP, out, timeout_s=900)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
