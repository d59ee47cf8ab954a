"""One tiny Llama trained the same way by a hand-written loop, by OverlapTrainer and by accelerate.

Every run draws the same global batches (a fixed token table, sequential order), uses AdamW with
a linear schedule and max-norm clipping, and returns the loss of each optimizer step averaged over
the whole global batch, so the three runs and one process compare number for number.
"""

from __future__ import annotations

import torch

SEQ = 8
VOCAB = 64
PER_RANK = 2
"""Sequences per dp rank per micro-batch."""
LR = 1e-2
CLIP = 1.0


def build_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)
    return LlamaForCausalLM(cfg)


class Tokens(torch.utils.data.Dataset):
    """`n` fixed sequences; each item is what a causal LM's `labels=` loss takes."""

    def __init__(self, n: int, seed: int = 1):
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def schedule(opt, steps: int):
    from transformers import get_linear_schedule_with_warmup

    return get_linear_schedule_with_warmup(opt, 0, steps)


def one_process(steps: int, global_batch: int, accumulate: int = 1) -> list[float]:
    """The plain model on the whole global batch: the reference every layout must reproduce."""
    model = build_llama()
    data = Tokens(steps * global_batch).ids
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    sched = schedule(opt, steps)
    losses = []
    for step in range(steps):
        batch = data[step * global_batch:(step + 1) * global_batch]
        total = 0.0
        for micro in batch.chunk(accumulate):
            loss = model(input_ids=micro, labels=micro).loss / accumulate
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def parallel_model(groups, **parallelize):
    import overlapkit

    return overlapkit.parallelize(build_llama(), groups.mesh, **parallelize)


def hand_loop(groups, steps: int) -> list[float]:
    """parallelize + DataParallel + AdamW, batches split by dp rank as accelerate splits them."""
    import torch.distributed as dist
    from overlapkit.data_parallel import DataParallel

    model = DataParallel(parallel_model(groups), groups.dp)
    dp = groups.sizes.dp
    data = Tokens(steps * PER_RANK * dp).ids
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    sched = schedule(opt, steps)
    losses = []
    for step in range(steps):
        start = (step * dp + groups.dp_rank) * PER_RANK
        batch = data[start:start + PER_RANK]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        sched.step()
        model.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=groups.dp)
        losses.append(mean.item() / dp)
    return losses


def training_args(out: str, steps: int, cls=None, **extra):
    from transformers import TrainingArguments

    base = dict(output_dir=out, max_steps=steps, per_device_train_batch_size=PER_RANK, learning_rate=LR,
                weight_decay=0.0, max_grad_norm=CLIP, lr_scheduler_type="linear", warmup_steps=0,
                optim="adamw_torch", logging_steps=1, save_strategy="no", report_to=[],
                train_sampling_strategy="sequential", use_cpu=True, disable_tqdm=True, seed=0,
                per_device_eval_batch_size=2)
    base.update(extra)
    return (cls or TrainingArguments)(**base)


def trainer_losses(trainer) -> list[float]:
    return [row["loss"] for row in trainer.state.log_history if "loss" in row]


def trainer_run(groups, out: str, steps: int, **extra):
    from overlapkit.integrations import OverlapTrainer

    dp = groups.sizes.dp
    trainer = OverlapTrainer(model=parallel_model(groups), args=training_args(out, steps, **extra),
                             train_dataset=Tokens(steps * PER_RANK * dp * extra.get("gradient_accumulation_steps", 1)),
                             groups=groups)
    trainer.train()
    return trainer


def accelerate_loop(groups, steps: int) -> list[float]:
    """The accelerate form: prepare_model, then accelerator.prepare of the optimizer and data loader."""
    import torch.distributed as dist
    from accelerate import Accelerator
    from overlapkit.integrations import prepare_model

    accelerator = Accelerator(cpu=True, step_scheduler_with_optimizer=False)
    model = prepare_model(accelerator, parallel_model(groups), groups)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    sched = schedule(opt, steps)
    loader = torch.utils.data.DataLoader(Tokens(steps * PER_RANK * groups.sizes.dp), batch_size=PER_RANK)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    losses = []
    for batch in loader:
        loss = model(**batch).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        sched.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=groups.dp)
        losses.append(mean.item() / groups.sizes.dp)
    return losses
