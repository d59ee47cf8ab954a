"""What the integrations refuse, on one process and before any collective: a layout other than tp x dp,
groups that lay out another world than accelerate runs,
a model that was not parallelized."""

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")


def _groups(**sizes):
    from overlapkit.runtime.groups import ParallelGroups, ParallelSizes

    return ParallelGroups(sizes=ParallelSizes(**sizes), rank=0, tp=None, dp=None, pp=None, ep=None)


def test_layouts_other_than_tp_by_dp_are_refused_naming_the_dim():
    from overlapkit.integrations.accelerator import check_layout

    with pytest.raises(ValueError, match=r"\{'pp': 2\}"):
        check_layout(_groups(tp=2, pp=2), 4)
    with pytest.raises(ValueError, match="lay out 4 ranks .* accelerate runs 2 processes"):
        check_layout(_groups(tp=2, dp=2), 2)
    with pytest.raises(TypeError, match="ParallelGroups"):
        check_layout(object(), 1)


def test_trainer_refuses_groups_of_another_world(tmp_path):
    import trainer_cases as tc
    from overlapkit.integrations import OverlapTrainer

    with pytest.raises(ValueError, match="lay out 2 ranks"):
        OverlapTrainer(model=tc.build_llama(), args=tc.training_args(str(tmp_path), 1), groups=_groups(tp=2),
                       train_dataset=tc.Tokens(2))


def test_accelerate_refuses_a_model_that_was_not_parallelized():
    from accelerate import Accelerator
    from overlapkit.integrations import prepare_model
    import trainer_cases as tc

    accelerator = Accelerator(cpu=True)
    with pytest.raises(ValueError, match="no DTensor parameter: parallelize it first"):
        prepare_model(accelerator, tc.build_llama(), _groups())
