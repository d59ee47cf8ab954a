"""The events of a Chrome/Kineto trace file, parsed whole (fast) or streamed (bounded memory).

A Kineto trace is one JSON object: a few metadata keys (`distributedInfo`, `deviceProperties`,
`baseTimeNanoseconds`, ...) and `traceEvents`, a list of 10^4–10^7 small objects. `json.loads`
of the whole file is the fastest way to read a small one, but holds every event as a Python dict
at once — about ten times the file's size. Above STREAM_ABOVE_BYTES the file is streamed
instead: read in chunks (through gzip when compressed), the events of a chunk decoded a few
hundred kB at a time in one call of the standard library's C decoder (an event at a time in
Python costs more than the decoding itself) and handed on before the next batch is decoded, so
memory holds one chunk, one batch and what the reader keeps of the events, not the events
themselves. Both give the same events, in order.

Traces of devices overlapkit cannot read (MTIA, XPU, HPU) are refused on sight of their first
device category, before the rest is parsed.
"""

from __future__ import annotations

import codecs
import gzip
import json
import os
import re
import zlib
from pathlib import Path

STREAM_ABOVE_BYTES = 8 << 20
"""Files larger than this (on disk, compressed or not) are streamed, not parsed whole."""
CHUNK_BYTES = 1 << 20
BATCH_CHARS = 1 << 18
"""Events are decoded this many characters at a time (about a thousand): few calls, and the decoded dicts
of one batch (several times its text) stay small beside what the reader keeps."""
UNSUPPORTED_DEVICES = {"mtia": "MTIA", "xpu": "XPU", "hpu": "HPU"}
"""Category prefixes of device activity overlapkit cannot read (its kernels are not CUDA/ROCm kernels)."""
_DEVICE_CAT = re.compile(r'"cat"\s*:\s*"(mtia|xpu|hpu)_', re.IGNORECASE)
_DEVICE_CAT_BYTES = re.compile(_DEVICE_CAT.pattern.encode(), re.IGNORECASE)
_SEP = re.compile(r"[\s,]*")
_WS = re.compile(r"\s*")


class TraceFileError(ValueError):
    """The file cannot be read as a trace; the message is the problem (the caller adds the path)."""


def unsupported(device_prefix: str) -> TraceFileError:
    return TraceFileError(f"unsupported device: {UNSUPPORTED_DEVICES[device_prefix.lower()]} "
                          f"(overlapkit reads CUDA/ROCm kernel traces and CPU gloo traces)")


class TraceEvents:
    """Iterate a trace file's events; `meta` holds its other top-level keys once iteration ended.

    `stream`: None picks by file size (STREAM_ABOVE_BYTES); `on_bytes(n)` is called with the bytes of
    the file consumed so far (a progress bar's feed).
    """

    def __init__(self, path: str | Path, stream: bool | None = None, on_bytes=None) -> None:
        self.path = Path(path)
        try:
            self.size = os.path.getsize(self.path)
        except OSError as e:
            raise TraceFileError(f"cannot read: {e.strerror or e}") from None
        self.stream = self.size > STREAM_ABOVE_BYTES if stream is None else stream
        self.on_bytes = on_bytes
        self.meta: dict = {}

    def __iter__(self):
        return self._streamed() if self.stream else self._whole()

    # -- the whole file at once ------------------------------------------------------------
    def _whole(self):
        try:
            raw = self.path.read_bytes()
        except OSError as e:
            raise TraceFileError(f"cannot read: {e.strerror or e}") from None
        if raw[:2] == b"\x1f\x8b":
            try:
                raw = gzip.decompress(raw)
            except (EOFError, gzip.BadGzipFile, zlib.error) as e:
                raise TraceFileError(f"truncated or corrupt gzip ({e})") from None
        # Refuse other devices' traces before parsing them (MTIA traces run to tens of MB of JSON).
        if (m := _DEVICE_CAT_BYTES.search(raw)) is not None:
            raise unsupported(m.group(1).decode())
        try:
            doc = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise TraceFileError(f"not a trace: not JSON ({e})") from None
        del raw
        if self.on_bytes:
            self.on_bytes(self.size)
        if isinstance(doc, dict):
            events = doc.pop("traceEvents", None)
            self.meta = doc
        else:
            events = doc
        if not isinstance(events, list):
            raise TraceFileError("not a trace: no traceEvents list of events")
        yield from events

    # -- streamed ---------------------------------------------------------------------------
    def _streamed(self):
        try:
            f = open(self.path, "rb")
        except OSError as e:
            raise TraceFileError(f"cannot read: {e.strerror or e}") from None
        with f:
            gz = f.read(2) == b"\x1f\x8b"
            f.seek(0)
            source = gzip.GzipFile(fileobj=f) if gz else f
            p = _Parser(source, f, self.on_bytes)
            try:
                yield from p.document(self.meta)
            except (EOFError, gzip.BadGzipFile, zlib.error) as e:
                raise TraceFileError(f"truncated or corrupt gzip ({e})") from None
            except UnicodeDecodeError as e:
                raise TraceFileError(f"not a trace: not JSON ({e})") from None


class _Parser:
    """A pull parser of `{"key": value, ..., "traceEvents": [event, ...], ...}` over a byte stream."""

    def __init__(self, source, raw_file, on_bytes) -> None:
        self.source, self.raw_file, self.on_bytes = source, raw_file, on_bytes
        self.decoder = codecs.getincrementaldecoder("utf-8")()
        self.scan = json.JSONDecoder().scan_once
        self.buf, self.pos, self.eof, self.tail = "", 0, False, ""
        self.fast = True  # try decoding the buffer's events in one call; reset by every chunk read

    def _fill(self) -> bool:
        if self.eof:
            return False
        data = self.source.read(CHUNK_BYTES)
        if self.on_bytes:
            self.on_bytes(self.raw_file.tell())
        text = self.decoder.decode(data, final=not data)
        if not data:
            self.eof = True
        # A device category split across two chunks is still seen: search the seam too.
        if (m := _DEVICE_CAT.search(self.tail + text)) is not None:
            raise unsupported(m.group(1))
        self.tail = text[-64:]
        self.buf = self.buf[self.pos:] + text
        self.pos, self.fast = 0, True
        return bool(data) or bool(text)

    def _skip(self, pattern) -> str:
        """Skip `pattern` and return the next character ('' at the end of the file)."""
        while True:
            self.pos = pattern.match(self.buf, self.pos).end()
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self._fill():
                return ""

    def _value(self):
        """Decode one JSON value at the cursor, reading on while the buffer may cut it short."""
        while True:
            try:
                value, end = self.scan(self.buf, self.pos)
            except StopIteration:
                value, end = None, -1
            except json.JSONDecodeError:
                value, end = None, -1
            # A value ending exactly at the buffer's end may be a number cut in two: read on first.
            if end != -1 and (end < len(self.buf) or self.eof):
                self.pos = end
                return value
            if not self._fill():
                if end != -1:
                    self.pos = end
                    return value
                raise TraceFileError(f"not a trace: not JSON (bad or truncated value at character "
                                     f"{self.pos} of a chunk)")

    def document(self, meta: dict):
        first = self._skip(_WS)
        if first == "[":  # a bare list of events
            yield from self._array()
            return
        if first != "{":
            raise TraceFileError("not a trace: not JSON (expected an object)")
        self.pos += 1
        seen_events = False
        while True:
            c = self._skip(_SEP)
            if c == "}" or c == "":
                break
            key = self._value()
            if self._skip(_WS) != ":":
                raise TraceFileError("not a trace: not JSON (expected ':')")
            self.pos += 1
            if key == "traceEvents" and self._skip(_WS) == "[":
                seen_events = True
                yield from self._array()
            else:
                self._skip(_WS)
                meta[key] = self._value()
        if not seen_events:
            raise TraceFileError("not a trace: no traceEvents list of events")

    def _array(self):
        self.pos += 1  # past '['
        while True:
            c = self._skip(_SEP)
            if c == "]":
                self.pos += 1
                return
            if c == "":
                raise TraceFileError("not a trace: not JSON (the event list is cut short)")
            if c == "{" and self.fast and (batch := self._batch()) is not None:
                yield from batch
            else:
                yield self._value()

    def _batch(self) -> list | None:
        """Every whole event from the cursor to the last `}` within BATCH_CHARS, decoded in one C call; None if that
        text is not a list of whole values (the last `}` closes something inside an event, or is past the
        event list's end): then one retry before where the decoder stopped, and failing that, events one at
        a time until the next chunk arrives.

        Safe because a JSON object is never a proper prefix of another value: if `[` + text + `]` decodes,
        its values are exactly the events the text starts with."""
        end = self.buf.rfind("}", self.pos, self.pos + BATCH_CHARS) + 1
        for _ in range(2):
            if end <= self.pos:
                break
            try:
                events = json.loads("[" + self.buf[self.pos:end] + "]")
            except json.JSONDecodeError as e:
                end = self.buf.rfind("}", self.pos, min(end - 1, self.pos + e.pos - 1)) + 1
                continue
            self.pos = end
            return events
        self.fast = False
        return None
