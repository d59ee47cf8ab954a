"""vocabulary: the sizes, overlap modes and validators every part reads, without importing torch."""

import itertools
import os
import subprocess
import sys

import pytest
import torch

from overlapkit.vocabulary import (DIMS, ENGINE_SWITCH, OVERLAP_MEANING, OVERLAP_MODES, ParallelSizes, check_bool,
                                   is_int_at_least, positive_int)


def test_importing_it_imports_no_torch():
    code = "import sys, overlapkit.vocabulary; print('torch' in sys.modules)"
    src = os.path.join(os.path.dirname(__file__), "..", "src")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": src}, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("value, minimum, ok", [(1, 1, True), (0, 1, False), (0, 0, True), (True, 1, False),
                                                 (2.0, 1, False), ("2", 1, False), (-3, -5, True)])
def test_is_int_at_least(value, minimum, ok):
    assert is_int_at_least(value, minimum) is ok


def test_positive_int_names_the_field_the_value_and_the_range():
    assert positive_int(3, "Config.x") == 3
    with pytest.raises(ValueError, match=r"^Config\.x=0 must be an integer >= 1$"):
        positive_int(0, "Config.x")
    with pytest.raises(TypeError, match=r"^depth=-1 must be an integer >= 0$"):
        positive_int(-1, "depth", minimum=0, error=TypeError)
    with pytest.raises(ValueError, match=r"flag=1 must be True or False"):
        check_bool(1, "flag")
    assert check_bool(False, "flag") is False


def test_parallel_sizes_lay_ranks_out_row_major_over_pp_dp_cp_tp():
    for pp, dp, cp, tp in itertools.product([1, 2, 3], [1, 2, 4], [1, 3], [1, 2, 3]):
        sizes = ParallelSizes(tp=tp, dp=dp, pp=pp, cp=cp)
        mesh = torch.arange(sizes.world_size).reshape(sizes.shape)  # the reference: torch's row-major layout
        for dim in DIMS:
            axis = DIMS.index(dim)
            assert sizes.groups_of(dim) == mesh.movedim(axis, -1).reshape(-1, sizes.shape[axis]).tolist()
        for rank in range(sizes.world_size):
            c = sizes.coords(rank)
            assert mesh[c.pp, c.dp, c.cp, c.tp].item() == rank == sizes.rank_of(c.tp, c.dp, c.pp, c.cp)
    assert ParallelSizes(dp=4, ep=2).ep_groups() == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="ParallelSizes.cp=0"):
        ParallelSizes(cp=0)
    with pytest.raises(ValueError, match="must divide dp"):
        ParallelSizes(dp=3, ep=2)


def test_every_engine_speaks_the_same_modes():
    assert set(OVERLAP_MEANING) == set(ENGINE_SWITCH)
    for engine, meanings in OVERLAP_MEANING.items():
        assert "none" in meanings and set(meanings) <= set(OVERLAP_MODES), engine
    from overlapkit.context_parallel import OVERLAPS
    from overlapkit.costmodel.parallel import MODES, TRANSPORTS as COST_TRANSPORTS
    from overlapkit.tensor_parallel.layers import OVERLAP_MODES as TP_MODES
    from overlapkit.tensor_parallel.pipelined import TRANSPORTS
    from overlapkit.vocabulary import TRANSPORTS as VOCAB_TRANSPORTS
    assert MODES == TP_MODES == OVERLAP_MODES and TRANSPORTS == COST_TRANSPORTS == VOCAB_TRANSPORTS
    assert OVERLAPS == tuple(OVERLAP_MEANING["cp"])
