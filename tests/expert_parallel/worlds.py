"""One spawned gloo world per world size for the whole EP test folder: each runs every case of
every test file that needs that size, once, and the tests read their part (spawns dominate the
cost on a 2-core machine)."""

import functools

from distributed import distributed


def _run(size: int) -> dict:
    # Imported here: the test modules import this one.
    from test_moe import _all_cases
    out = dict(cases=_all_cases())
    if size == 2:
        from test_bad_input_and_overlap import _bad_inputs, _overlap_from_spans
        from overlapkit.demos import run_rank
        from test_demo_ep import DEMO
        from test_auto_chunks import _auto_chunks, _padded_needs_equal_tokens
        out.update(bad=_bad_inputs(), overlap=_overlap_from_spans(), demo=run_rank(DEMO), auto=_auto_chunks(),
                   padded_tokens=_padded_needs_equal_tokens())
    if size == 4:
        from test_gpt_moe import _tp_and_gpt
        out.update(_tp_and_gpt())
    return out


@distributed(world_size=2, timeout_s=90)
def _world2():
    return _run(2)


@distributed(world_size=3, timeout_s=90)
def _world3():
    return _run(3)


@distributed(world_size=4, timeout_s=90)
def _world4():
    return _run(4)


@functools.cache
def world(size: int) -> list[dict]:
    """Every rank's results of the world of `size` ranks (spawned on first use)."""
    return {2: _world2, 3: _world3, 4: _world4}[size]()
