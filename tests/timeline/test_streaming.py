"""The streamed reader: the same trace as a whole parse, in a fraction of its memory, with a progress bar."""

import gzip
import importlib.util
import io
import json
import tracemalloc
from pathlib import Path

import pytest

from overlapkit.timeline.progress import Progress
from overlapkit.timeline.trace import read_trace, read_traces

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "analyze_large.py"


def _generator():
    spec = importlib.util.spec_from_file_location("analyze_large", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _peak(fn):
    tracemalloc.start()
    try:
        out = fn()
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_streaming_reads_the_same_trace_in_bounded_memory(tmp_path):
    path = tmp_path / "rank0.pt.trace.json"
    size = _generator().write_trace(path, 0, 2, 6.0, slow_rank=None)
    assert size > 5e6
    streamed, peak_streamed = _peak(lambda: read_trace(path, stream=True))
    whole, peak_whole = _peak(lambda: read_trace(path, stream=False))
    assert streamed.spans == whole.spans and streamed.issue == whole.issue
    assert streamed.host_ops == whole.host_ops and streamed.origin_unix_ms == whole.origin_unix_ms
    # json.loads holds every event at once (about 6x the file); the stream holds a chunk and what it keeps:
    # the spans, launches and host ops the report needs (about the file's size for this kernel-dense trace,
    # less for real ones, whose args, flows and Python frames are dropped as read)
    assert peak_whole > 3 * size
    assert peak_streamed < 1.5 * size and peak_streamed < 0.25 * peak_whole, (size, peak_streamed, peak_whole)


def test_streaming_a_gzipped_trace_and_its_errors(tmp_path):
    path = tmp_path / "rank0.pt.trace.json"
    _generator().write_trace(path, 0, 2, 0.3, slow_rank=None)
    gz = tmp_path / "rank0.pt.trace.json.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    assert read_trace(gz, stream=True).spans == read_trace(path, stream=False).spans
    cut = tmp_path / "cut.json.gz"
    cut.write_bytes(gz.read_bytes()[: gz.stat().st_size // 2])
    with pytest.raises(Exception, match="truncated or corrupt gzip"):
        read_trace(cut, stream=True)
    bad = tmp_path / "cut.json"
    bad.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(Exception, match="not JSON"):
        read_trace(bad, stream=True)


def test_the_progress_bar_counts_every_byte(tmp_path):
    gen = _generator()
    files = [tmp_path / f"rank{r}.pt.trace.json" for r in range(2)]
    total = sum(gen.write_trace(f, r, 2, 0.3, slow_rank=1) for r, f in enumerate(files))
    out = io.StringIO()
    with Progress(files, show=True, stream=out) as bar:
        traces = read_traces([str(f) for f in files], stream=True, progress=bar)
        assert bar.done == total
    # not a terminal: plain lines (a live bar would show only at the end), the first before any byte is read
    lines = out.getvalue().splitlines()
    assert lines[0] == f"overlapkit analyze: reading 2 trace(s), {total / 1e6:.1f} MB", lines
    assert lines[-1].startswith(f"overlapkit analyze: read {total / 1e6:.1f} MB in "), lines
    quiet = Progress(files, show=None, stream=io.StringIO())  # not asked, not a terminal: nothing
    assert quiet.bar is None and not quiet.lines


def test_progress_lines_come_every_second_while_a_trace_streams(tmp_path, monkeypatch):
    from overlapkit.timeline import jsonstream, progress

    path = tmp_path / "rank0.pt.trace.json"
    _generator().write_trace(path, 0, 2, 0.5, slow_rank=None)
    monkeypatch.setattr(jsonstream, "CHUNK_BYTES", 50_000)
    monkeypatch.setattr(progress, "LINE_EVERY_S", 0.0)
    out = io.StringIO()
    with Progress([path], show=True, stream=out) as bar:
        read_traces([str(path)], stream=True, progress=bar)
    middle = out.getvalue().splitlines()[1:-1]
    assert len(middle) >= 5 and all(" MB (" in line for line in middle), middle


def _kineto():
    spec = importlib.util.spec_from_file_location("kineto_trace", BENCH.parent / "_lib" / "kineto_trace.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_profiler_shaped_trace_streams_to_the_same_report(tmp_path):
    # the shape of the 200 MB test of record (benchmarks/analyze_large.py --one-rank-mb), at 2 MB
    path = tmp_path / "rank0.json"
    _kineto().write_trace(path, 2.0)
    streamed, whole = read_trace(path, stream=True), read_trace(path, stream=False)
    assert streamed.spans == whole.spans and streamed.step_ranges == whole.step_ranges
    assert streamed.host_ops == whole.host_ops and len(streamed.steps) >= 2
    kinds = {s.kind for s in streamed.spans}
    assert {"all_gather", "reduce_scatter", "compute"} <= kinds, kinds


def test_batches_cut_anywhere_decode_the_same_events(tmp_path, monkeypatch):
    # braces inside strings, lists of objects inside events, and metadata with braces after the event list:
    # a batch whose last `}` is not an event's end must fall back, never decode something else
    from overlapkit.timeline import jsonstream

    events = []
    for i in range(300):
        events.append({"ph": "X", "cat": "cpu_op", "name": "}, {" * (i % 3) + f"op{i}", "ts": i, "dur": 1,
                       "args": {"shapes": [{"a": [i, {"b": "}]"}]}, {"c": i}], "note": "{\"x\": }"}})
    doc = {"schemaVersion": 1, "traceEvents": events, "deviceProperties": [{"name": "}{"}], "z": {"y": {}}}
    path = tmp_path / "tricky.json"
    path.write_text(json.dumps(doc))
    for chunk, batch in ((97, 61), (1000, 333), (4096, 1 << 18)):
        monkeypatch.setattr(jsonstream, "CHUNK_BYTES", chunk)
        monkeypatch.setattr(jsonstream, "BATCH_CHARS", batch)
        source = jsonstream.TraceEvents(path, stream=True)
        assert list(source) == events and source.meta["deviceProperties"] == [{"name": "}{"}], (chunk, batch)
