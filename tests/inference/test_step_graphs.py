"""What StepGraphs does without a GPU: the signature of a call, and outputs cloned out of the graph's memory.

The capture and replay themselves need CUDA (tests/gpu/test_decode_graphs.py).
"""

import contextlib

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


class _FakeCuda:
    """torch.cuda's graph API on CPU: a capture runs the function with `capturing` set (a real capture runs no
    kernel, so the function's in-place effects must not happen), a replay runs what it recorded."""

    def __init__(self):
        self.capturing, self.captured = False, None
        fake = self

        class Graph:
            def replay(self):
                self.fn()

        class Capture:
            def __init__(self, graph, pool=None, stream=None):
                fake.captured = graph

            def __enter__(self):
                fake.capturing = True

            def __exit__(self, *exc):
                fake.capturing = False

        class Stream:
            def wait_stream(self, other):
                pass

        self.CUDAGraph, self.graph, self.Stream = Graph, Capture, Stream
        self.graph_pool_handle = object
        self.current_stream = Stream
        self.stream = lambda s: contextlib.nullcontext()
        self.synchronize = lambda: None


def test_each_call_moves_the_state_once_warm_up_capture_and_replay_alike(monkeypatch):
    # A decode step advances its cache in place (transformers' static cache: cumulative_length.add_(1) on the
    # device). Warm-up calls made on the side moved it once per extra call and every later step wrote past
    # its place (an H100 run: index_copy_ out of bounds). Each call must move it exactly once.
    from overlapkit.inference import graphs as G

    fake = _FakeCuda()
    monkeypatch.setattr(G.torch, "cuda", fake)
    position = torch.zeros((), dtype=torch.long)
    written = []

    def body(x):
        written.append((int(position), float(x)))
        position.add_(1)
        return x * 10 + position

    def step(x):
        if not fake.capturing:
            return body(x)
        out = torch.empty(())  # the graph's output buffer: each replay writes the step's result into it
        fake.captured.fn = lambda: out.copy_(body(x))
        return out

    graphs = G.StepGraphs(step, warmup=2)
    got = [float(graphs(x=torch.tensor(float(i)))) for i in range(6)]
    assert [p for p, _ in written] == list(range(6)), written  # one position a call, in order
    assert [x for _, x in written] == [float(i) for i in range(6)]  # each call's own input
    assert graphs.replays == 4  # two eager warm-up calls, then the capture's call and three more replayed
    assert got == [10.0 * i + i + 1 for i in range(6)]


def test_refused_signatures_are_bounded_as_the_warm_up_counts_are(monkeypatch):
    # each generate() brings a new KV cache object, so a new signature: a capture refused for every one of them
    # must not keep every refusal for the model's life
    from overlapkit.inference import graphs as G

    fake = _FakeCuda()
    monkeypatch.setattr(G.torch, "cuda", fake)

    def step(x, cache):
        if fake.capturing:
            raise RuntimeError("operation not permitted when stream is capturing\nmore")
        return x + 1

    graphs = G.StepGraphs(step, warmup=1, keep=2)
    caches = [object() for _ in range(20)]  # all alive: no id is another's
    for cache in caches:  # a new cache: a new signature, warmed up once, then refused
        assert float(graphs(x=torch.tensor(1.0), cache=cache)) == 2.0
        assert float(graphs(x=torch.tensor(1.0), cache=cache)) == 2.0
    assert len(graphs.refused) == 8 and graphs.replays == 0
    assert set(graphs.refused.values()) == {"operation not permitted when stream is capturing"}
