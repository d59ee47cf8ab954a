"""TRL's SFTTrainer through the same path: tp 2, a tiny in-memory dataset, the losses of one process.

SFTConfig's own defaults stay on (activation checkpointing); its bf16 default is the second run,
mixed precision through the same path, which must stay near the fp32 losses.

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
    out_rows = {}
    for bf16 in (False, True):  # SFTConfig's default is bf16=True: mixed precision (accelerate's autocast)
        args = tc.training_args(f"{out}/{bf16}", STEPS, cls=SFTConfig, bf16=bf16)
        trainer = OverlapSFTTrainer(model=tc.parallel_model(groups), args=args, train_dataset=data,
                                    processing_class=_tokenizer(), groups=groups)
        trainer.train()
        out_rows[bf16] = [row for row in trainer.state.log_history if "loss" in row]
    return {"losses": [row["loss"] for row in out_rows[False]], "keys": sorted(out_rows[False][-1]),
            "bf16": [row["loss"] for row in out_rows[True]]}


def test_sft_trainer_gives_one_process_losses(tmp_path):
    reference = tc.one_process(STEPS, global_batch=tc.PER_RANK)
    for rank in _sft(str(tmp_path)):
        assert len(rank["losses"]) == STEPS
        assert all(abs(a - b) <= 1e-6 * b for a, b in zip(rank["losses"], reference)), (rank["losses"], reference)
        assert "mean_token_accuracy" in rank["keys"] and "overlap/exposed_comm_ms" in rank["keys"], rank["keys"]
        assert all(abs(a - b) <= 1e-2 * b for a, b in zip(rank["bf16"], reference)), (rank["bf16"], reference)
        assert rank["bf16"] != rank["losses"]  # autocast really ran
