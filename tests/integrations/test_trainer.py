"""Trainer, accelerate and a hand-written loop train the same overlapkit Llama at tp 2 x dp 2.

One world of four gloo ranks runs the three in sequence: 20 optimizer steps each, the losses of
every step equal (fp32, rel <= 1e-6) to each other and to one process on the same global batch.
A second pair of worlds checks what a run outlives: a Trainer checkpoint (DCP under the hood)
taken at tp 2 x dp 2 and resumed at tp 1 x dp 2 continues with the uninterrupted run's losses;
`save_model` writes a checkpoint a plain `from_pretrained` loads whole; evaluation gathers over
dp only and matches one process; the overlap report is logged beside the loss.
"""

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from distributed import distributed  # noqa: E402

import trainer_cases as tc  # noqa: E402  (pytest puts this folder on sys.path; spawned ranks inherit it)

STEPS = 20
REL = 1e-6


def _close(a: list[float], b: list[float], rel: float = REL) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= rel * abs(y) for x, y in zip(a, b))


@distributed(world_size=4, timeout_s=600)
def _three_ways(out: str):
    import overlapkit

    groups = overlapkit.init(tp=2, dp=2)
    return {"hand": tc.hand_loop(groups, STEPS),
            "trainer": tc.trainer_losses(tc.trainer_run(groups, out, STEPS)),
            "accelerate": tc.accelerate_loop(groups, STEPS)}


def test_hand_loop_trainer_and_accelerate_give_one_process_losses(tmp_path):
    reference = tc.one_process(STEPS, global_batch=2 * tc.PER_RANK)
    for rank, runs in enumerate(_three_ways(str(tmp_path))):
        for name, losses in runs.items():
            assert _close(losses, reference), (rank, name, losses, reference)


RESUME_AT, TOTAL = 3, 6


@distributed(world_size=4, timeout_s=600)
def _train_and_save(out: str):
    import overlapkit
    from overlapkit.models.hf_checkpoint import full_state_dict

    groups = overlapkit.init(tp=2, dp=2)
    trainer = tc.trainer_run(groups, out, TOTAL, save_strategy="steps", save_steps=RESUME_AT,
                             gradient_accumulation_steps=2, per_device_train_batch_size=1,
                             eval_strategy="no")
    trainer.save_model(f"{out}/final")
    metrics = trainer.evaluate(tc.Tokens(7, seed=9))
    logged = [row for row in trainer.state.log_history if "loss" in row]
    return {"losses": tc.trainer_losses(trainer), "eval_loss": metrics["eval_loss"],
            "overlap_keys": sorted(k for k in logged[-1] if k.startswith("overlap/")),
            "weights": {k: v.clone() for k, v in full_state_dict(trainer.model).items()}}


@distributed(world_size=2, timeout_s=600)
def _resume(out: str):
    import overlapkit
    from overlapkit.integrations import OverlapTrainer

    groups = overlapkit.init(tp=1, dp=2)  # another layout: the checkpoint was written at tp 2 x dp 2
    args = tc.training_args(f"{out}/resumed", TOTAL, gradient_accumulation_steps=2, per_device_train_batch_size=1)
    trainer = OverlapTrainer(model=tc.parallel_model(groups), args=args, groups=groups,
                             train_dataset=tc.Tokens(TOTAL * 2 * 2))
    trainer.train(resume_from_checkpoint=f"{out}/checkpoint-{RESUME_AT}")
    return tc.trainer_losses(trainer)


def test_checkpoint_resumes_at_another_layout_and_save_model_loads_plain(tmp_path):
    from transformers import LlamaForCausalLM

    out = str(tmp_path)
    first = _train_and_save(out)
    whole = first[0]
    reference = tc.one_process(TOTAL, global_batch=4, accumulate=2)
    assert _close(whole["losses"], reference), (whole["losses"], reference)
    for later in first[1:]:
        assert later["losses"] == whole["losses"]

    resumed = _resume(out)
    for losses in resumed:  # the checkpoint's log history, then the steps run after it
        assert losses[:RESUME_AT] == whole["losses"][:RESUME_AT], (losses, whole["losses"])
        assert _close(losses[RESUME_AT:], whole["losses"][RESUME_AT:]), (losses, whole["losses"])

    plain = LlamaForCausalLM.from_pretrained(f"{out}/final")
    for name, value in plain.state_dict().items():
        assert torch.equal(value, whole["weights"][name]), name
    ids = tc.Tokens(7, seed=9).ids
    with torch.no_grad():
        per = [plain(input_ids=ids[i:i + 1], labels=ids[i:i + 1]).loss.item() for i in range(7)]
    # accelerate's even batches over dp 2, 2 a batch: rank 0 [0,1] [4,5], rank 1 [2,3] [6,0 (padding)];
    # the Trainer repeats each batch's mean loss per sample, and the last gather keeps 7 % 4 = 3 of them:
    # [4,5] twice and [6,0] once. Gathered over every rank instead, it would keep [4,5] three times.
    pair = lambda a, b: (per[a] + per[b]) / 2  # noqa: E731
    expected = (2 * pair(0, 1) + 2 * pair(2, 3) + 2 * pair(4, 5) + pair(6, 0)) / 7
    for rank in first:
        assert abs(rank["eval_loss"] - expected) <= 1e-5 * expected, (rank["eval_loss"], expected)
    keys = whole["overlap_keys"]
    assert "overlap/exposed_comm_ms" in keys and any(k.startswith("overlap/exposed_ms/tp_") for k in keys), keys
    assert any(k.startswith("overlap/exposed_ms/dp_") for k in keys), keys
