"""Message size, group size and process group of a traced collective, from whatever record the trace holds.

Bandwidth needs the bytes a collective moved and the ranks it moved them over. PyTorch writes
them in several shapes, depending on its version and backend:

- `record_param_comms` ops (and, on newer NCCL traces, the kernel's own args): `In msg nelems`,
  `Out msg nelems`, `dtype`, `Group size`, `Process Group Ranks`, `Process Group Name` /
  `Process Group ID` — message = max(in, out) elements x the dtype's size (the full buffer);
- older `record_param_comms` ops recorded with `record_shapes=True`: only `Input Dims` /
  `Input type` of the op's first argument (its input tensor);
- gloo's `gloo:<collective>` ranges recorded with shapes: the same `Input Dims` / `Input type`.

Unknown values are 0 (sizes) and '' (group): the tables print them as "?".
"""

from __future__ import annotations

DTYPE_BYTES = {"float": 4, "float32": 4, "half": 2, "float16": 2, "bfloat16": 2, "c10::bfloat16": 2,
               "c10::half": 2, "double": 8, "float64": 8, "int": 4, "int32": 4, "long": 8, "int64": 8,
               "short": 2, "int16": 2, "char": 1, "byte": 1, "int8": 1, "uint8": 1, "bool": 1,
               "float8_e4m3fn": 1, "float8_e5m2": 1, "c10::float8_e4m3fn": 1, "c10::float8_e5m2": 1}
"""Bytes per element of the dtype names traces write (lower-cased)."""
METADATA_KEYS = ("Collective name", "In msg nelems", "Out msg nelems", "dtype", "Group size", "Process Group Ranks",
                 "Process Group Name", "Process Group ID", "Input Dims", "Input type")
"""The args of a collective record the reader keeps (the rest of a kernel's args is dropped early)."""


def dtype_bytes(dtype: object) -> int:
    """Bytes per element of a trace's dtype name (`Float`, `BFloat16`, `c10::Half`); 0 when unknown."""
    return DTYPE_BYTES.get(str(dtype).lower(), 0)


def _int(value) -> int:
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        return 0


def input_bytes(args: dict) -> int:
    """Bytes of a recorded op's first input from `Input Dims` / `Input type`; 0 when not recorded.

    A list of tensors (`TensorList`) has no element type in the trace, so its size is unknown.
    """
    dims, types = args.get("Input Dims") or [], args.get("Input type") or []
    if not dims or not isinstance(dims[0], list) or not types or not dims[0]:
        return 0
    if not all(isinstance(d, int) for d in dims[0]):
        return 0
    n = 1
    for d in dims[0]:
        n *= d
    return n * dtype_bytes(types[0])


def process_group(meta: dict) -> str:
    """The group as the trace names it: its ranks ('[0, 1]'), else 'pg <name or id>'; '' when unknown."""
    ranks = str(meta.get("Process Group Ranks", "") or "")
    if ranks.startswith("["):
        return ranks
    for key in ("Process Group Name", "Process Group ID"):
        if meta.get(key) not in (None, ""):
            return f"pg {meta[key]}"
    return ""


def message(meta: dict) -> tuple[int, int, str]:
    """(message bytes, group size, process group) of one collective record; 0 / '' where unknown."""
    elems = max(_int(meta.get("In msg nelems")), _int(meta.get("Out msg nelems")))
    nbytes = elems * dtype_bytes(meta.get("dtype", "")) if elems else input_bytes(meta)
    return nbytes, _int(meta.get("Group size")), process_group(meta)


def size_text(n: int) -> str:
    """A message size as the tables print it: '7.8 MiB', '424 B', '?' when unknown."""
    if n <= 0:
        return "?"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def keep(args: dict) -> dict:
    """The part of an event's args a collective's size and group need (kernel args carry many more)."""
    return {k: args[k] for k in METADATA_KEYS if k in args}
