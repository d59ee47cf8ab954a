"""Build small Kineto-shaped traces for the reader's tests: the fields PyTorch's profiler writes."""

import gzip
import json


class TraceBuilder:
    """Events of one rank; times in µs. `launch` puts a kernel on the GPU and its launch on a CPU thread."""

    def __init__(self, rank=0, world_size=2, base_ns=1_700_000_000_000_000_000):
        self.rank, self.world_size, self.base_ns = rank, world_size, base_ns
        self.events = []
        self._corr = 100

    def cpu(self, name, ts, dur, cat="user_annotation", tid=1, **args):
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": 10, "tid": tid, "ts": ts, "dur": dur,
                            "args": args})

    def launch(self, name, ts, dur, at, stream=7, cat="kernel", tid=1, launch_us=1, **args):
        """A GPU event running [ts, ts+dur] on `stream`, launched from thread `tid` at time `at` (the launch call
        taking `launch_us`)."""
        self._corr += 1
        self.events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 10, "tid": tid,
                            "ts": at, "dur": launch_us, "args": {"correlation": self._corr}})
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
                            "args": {"stream": stream, "device": 0, "correlation": self._corr, **args}})

    def doc(self, rank=True):
        d = {"schemaVersion": 1, "traceEvents": self.events, "baseTimeNanoseconds": self.base_ns}
        if rank:
            d["distributedInfo"] = {"backend": "nccl", "rank": self.rank, "world_size": self.world_size}
        return d

    def write(self, path, rank=True, gz=False):
        data = json.dumps(self.doc(rank)).encode()
        path.write_bytes(gzip.compress(data) if gz else data)
        return path
