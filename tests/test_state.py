"""runtime.state: every piece of process state that outlives a call is registered, and reset() forgets it."""

import importlib

from overlapkit.runtime import state

# (module, its global, registry entry): the state each keeps, by the name it registered.
KEPT = [
    ("overlapkit.runtime.agreement", "_SEQ", "agreement.checks_per_group"),
    ("overlapkit.runtime.comm", "_sizes", "comm.size_rank"),
    ("overlapkit.expert_parallel.experts", "_GROUPED_BROKEN", "experts.grouped_mm_refused"),
    ("overlapkit.context_parallel.kernels", "_CUDNN_BROKEN", "ring_attention.cudnn_refused"),
    ("overlapkit.tensor_parallel.params", "_meshes", "tp.meshes_of_groups"),
    ("overlapkit.tensor_parallel.symm_mem", "_workspaces", "symm_mem.workspaces"),
    ("overlapkit.tensor_parallel.precision", "_FUSED_ACCUMULATE", "fused_addmm_accumulate"),
    ("overlapkit.timeline.framework", "_cache", "trace.framework_of_name"),
]


def test_modules_keep_their_state_in_the_registry_and_reset_empties_it():
    held = []
    for module, attr, entry in KEPT:
        container = getattr(importlib.import_module(module), attr)
        registered = state.names()
        assert entry in registered["group"] + registered["capability"], entry
        kind = type(container)
        same = (state.cache_set if kind is set else state.cache_dict)(entry) if entry in registered["group"] \
            else (state.capability_set if kind is set else state.capability_dict)(entry)
        assert same is container, f"{module}.{attr} is not the registry's {entry!r}"
        if kind is set:
            container.add(("probe", 1))
        else:
            container[("probe", 1)] = 1
        held.append(container)
    state.reset()
    assert all(len(c) == 0 for c in held)


def test_a_name_keeps_its_kind_and_clearers_run():
    d = state.cache_dict("test.kind")
    assert state.cache_dict("test.kind") is d
    try:
        state.cache_set("test.kind")
    except TypeError as e:
        assert "test.kind" in str(e) and "dict" in str(e)
    else:
        raise AssertionError("a dict name reused as a set must fail")
    cleared = []
    state.register_clear("test.clear", lambda: cleared.append(1))
    state.reset()
    assert cleared == [1]


def test_process_wiring_lives_in_the_registry_and_survives_reset():
    """The active recorder and a spawned rank's queue to its parent are process wiring, not caches:
    registered (no module global holds them) and left alone by reset(), which runs between tests."""
    import overlapkit.launch  # noqa: F401 (registers its wiring)
    from overlapkit.timeline import record

    assert {"recorder.active", "launch.parent"} <= set(state.names()["process"])
    with record() as rec:
        state.reset()
        from overlapkit.runtime import recorder
        assert recorder.active() is rec
