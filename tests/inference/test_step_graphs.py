"""What StepGraphs does without a GPU: the signature of a call, and outputs cloned out of the graph's memory.

The capture and replay themselves need CUDA (tests/gpu/test_decode_graphs.py).
"""

import torch

from overlapkit.inference.graphs import _cloned, _key


def test_signature_is_shapes_values_and_object_identity():
    a, b = object(), object()
    assert _key(torch.ones(2, 3)) == _key(torch.zeros(2, 3))
    assert _key(torch.ones(2, 3)) != _key(torch.ones(3, 3)) != _key(torch.ones(3, 3, dtype=torch.float64))
    assert _key(True) != _key(False) and _key(4) == _key(4)
    assert _key(a) == _key(a) and _key(a) != _key(b)


def test_outputs_are_cloned_whatever_holds_them():
    from transformers.modeling_outputs import CausalLMOutputWithPast

    logits = torch.randn(2, 1, 8)
    for out, get in ((logits, lambda o: o), ((logits, 3), lambda o: o[0]),
                     (CausalLMOutputWithPast(logits=logits), lambda o: o.logits)):
        copy = _cloned(out)
        assert type(copy) is type(out)
        assert torch.equal(get(copy), logits) and get(copy).data_ptr() != logits.data_ptr()
