"""TRL's SFTTrainer through the same path: tp 2, a tiny in-memory dataset, the losses of one process.

Known wrong (xfail, strict): the losses drift from one process after the first step (see the mark).

TRL scores tokens with a fused LM head of its own; OverlapSFTTrainer answers that call from the
vocabulary-split logits (overlapkit's cross-entropy), so the loss of every step equals the plain
model's on the same batches, and TRL's token accuracy and entropy are logged beside it.
"""

import pytest

pytest.importorskip("transformers")
pytest.importorskip("trl")

from distributed import distributed  # noqa: E402

import trainer_cases as tc  # noqa: E402

STEPS = 4
GRAD_CKPT = False
"""SFTConfig turns activation checkpointing on by default; this run compares the loss path, so it is off."""


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # The padding token is outside the data's ids: TRL's collator drops it from the labels, and the batches
    # here are never padded (equal lengths), so the loss covers the tokens one process scores.
    vocab = {f"t{i}": i for i in range(tc.VOCAB)} | {"<pad>": tc.VOCAB}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<pad>", unk_token="<pad>")


@distributed(world_size=2, timeout_s=600)
def _sft(out: str):
    import overlapkit
    from datasets import Dataset
    from overlapkit.integrations import OverlapSFTTrainer
    from trl import SFTConfig

    groups = overlapkit.init(tp=2, dp=1)
    data = Dataset.from_dict({"input_ids": tc.Tokens(STEPS * tc.PER_RANK).ids.tolist()})
    args = tc.training_args(out, STEPS, cls=SFTConfig, gradient_checkpointing=GRAD_CKPT)
    trainer = OverlapSFTTrainer(model=tc.parallel_model(groups), args=args, train_dataset=data,
                                processing_class=_tokenizer(), groups=groups)
    trainer.train()
    rows = [row for row in trainer.state.log_history if "loss" in row]
    return {"losses": [row["loss"] for row in rows], "keys": sorted(rows[-1])}


@pytest.mark.xfail(strict=True, reason="OverlapSFTTrainer's first-step gradients differ from OverlapTrainer's on the same "
                   "batch by up to 1% (norms, k/q projections) while the loss agrees to 1.4e-6; the replaced fused "
                   "head alone gives exact gradients, so the cause is elsewhere in the SFT path: not found yet")
def test_sft_trainer_gives_one_process_losses(tmp_path):
    reference = tc.one_process(STEPS, global_batch=tc.PER_RANK)
    for rank in _sft(str(tmp_path)):
        assert len(rank["losses"]) == STEPS
        assert all(abs(a - b) <= 1e-6 * b for a, b in zip(rank["losses"], reference)), (rank["losses"], reference)
        assert "mean_token_accuracy" in rank["keys"] and "overlap/exposed_comm_ms" in rank["keys"], rank["keys"]
