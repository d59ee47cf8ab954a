"""Training stacks by name: the implementation settings a framework of a given year used, so that a
prediction of its step prices the same attention kernel, pipeline sends and gradient reduction.

How much communication a step can hide depends on more than the split: whether the attention scores
are materialized (more compute to hide behind), whether pipeline sends are split over the TP ranks,
the dtype and bucket size of the gradient reduction, where it may start. A paper states its split and
batch; these it leaves to its framework. `overlapkit plan --stack NAME` (or `--stack file.json`, the same
format) fills them from data/stacks/NAME.json, where every setting carries why, from that framework's
code or documentation; what neither the flags nor the stack give takes overlapkit's default, and every
value so filled is listed as an assumption (`plan --json` key `assumptions`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING
from importlib import resources
from pathlib import Path

from ..vocabulary import TRANSPORTS, positive_int
from . import _validate as v
from .parallel import ATTENTION, GRAD_ACCUMULATION, WEIGHTS

if TYPE_CHECKING:
    from .model import ModelConfig
    from .parallel import ParallelConfig

GRAD_DTYPES = ("bf16", "fp16", "fp32", "params", "fp32-for-bf16")
"""A stack's gradient-reduction dtype: bf16, fp16 or fp32 as such; params: the parameter dtype (torch DDP,
DeepSpeed's communication_data_type default); fp32-for-bf16: Megatron's rule (fp32 under bf16, the
parameter dtype under fp16)."""
MEGATRON_CORE_BUCKETS = "megatron-core"
"""bucket_mb rule: Megatron-Core DDP's max(40M, 1M x dp) elements at the reduction dtype."""

STACK_FIELDS = ("attention", "pp_scatter_gather", "weights", "grad_dtype", "bucket_mb", "grad_accumulation",
                "dp_in_drain", "eager", "zero3_prefetch", "zero3_wrap", "tp_transport")
"""The plan settings a stack may fill: how the framework computes and communicates, never the split,
the batch, the recomputation or the overlap switches, which a run states."""

DEFAULTS = (
    ("tp", 1, "no tensor parallelism"),
    ("pp", 1, "no pipeline"),
    ("vpp", 1, "no interleaving"),
    ("dp", 1, "one data-parallel replica"),
    ("cp", 1, "no context parallelism"),
    ("ep", 1, "no expert parallelism"),
    ("micro_batch", 1, "one sequence per micro-batch"),
    ("first_stage_layers", 0, "the layers split evenly over the stages"),
    ("last_stage_layers", 0, "the layers split evenly over the stages"),
    ("hardware", "h200-sxm", "the GPU overlapkit's curves are measured on"),
    ("dtype", "bf16", "mixed precision in bf16"),
    ("recompute", "none", "no activation recomputation"),
    ("zero", 0, "no optimizer-state sharding"),
    ("sp", True, "sequence parallelism on (it makes TP's collectives overlappable)"),
    ("overlap", "none", "every engine's overlap off unless asked"),
    ("attention", "flash", "fused attention at the rate measured on H200 (cuDNN / FlashAttention-3 class)"),
    ("pp_scatter_gather", False, "pipeline sends carry whole tensors"),
    ("weights", "master", "parameters in the compute dtype, fp32 master copies in the optimizer"),
    ("grad_dtype", "bf16", "gradients reduced in bf16"),
    ("bucket_mb", 25.0, "PyTorch DDP's default bucket_cap_mb"),
    ("grad_accumulation", "fused", "micro-batch gradients accumulated inside the wgrad GEMM"),
    ("dp_in_drain", False, "the DP reduction waits for the whole pipeline schedule"),
    ("eager", False, "memory-bound ops fused (compiled)"),
    ("zero3_prefetch", "auto", "ZeRO-3 prefetch depth chosen by fsdp_prefetch_choice"),
    ("zero3_wrap", 1, "one transformer layer per ZeRO-3 unit"),
    ("tp_transport", "p2p", "pipelined TP chunks over NCCL send/recv"),
    ("moe_chunks", 4, "MoE all-to-all in 4 token chunks when EP overlap is on"),
    ("flops", "megatron2024", "Megatron-LM's FLOP count for the TFLOP/s and MFU printed"),
)
"""(plan setting, overlapkit's value, why) for every setting a run may leave out, when no stack fills it."""


@dataclass(frozen=True)
class StackSetting:
    """One setting of a stack, with the reason it is the framework's."""

    field: str
    """The plan setting it fills (one of STACK_FIELDS, spelled as the flag's destination)."""
    value: object
    """Its value: the flag's own values, or a rule (GRAD_DTYPES, MEGATRON_CORE_BUCKETS) resolved per run."""
    why: str
    """Where in the framework's code or documentation the value comes from."""


@dataclass(frozen=True)
class Stack:
    """A framework's implementation settings, as data (data/stacks/*.json)."""

    name: str
    """The name `--stack` takes (the file's stem for a user's own file without one)."""
    summary: str
    """One paragraph: what the framework does that the settings describe."""
    sources: tuple[str, ...]
    """The code and documents the settings were read from."""
    settings: tuple[StackSetting, ...]
    """The settings it fills, each with its reason."""

    def __post_init__(self) -> None:
        o = f"stack({self.name})"
        seen = set()
        for s in self.settings:
            if s.field not in STACK_FIELDS:
                raise v.ConfigError(f"{o}.settings.{s.field}: not a stack setting; known: {', '.join(STACK_FIELDS)}")
            if s.field in seen:
                raise v.ConfigError(f"{o}.settings.{s.field}: given twice")
            seen.add(s.field)
            _check_value(o, s.field, s.value)
            if not isinstance(s.why, str) or not s.why.strip():
                raise v.ConfigError(f"{o}.settings.{s.field}.why: say where the value comes from")
        if not self.sources:
            raise v.ConfigError(f"{o}.sources: name at least one document or file the settings come from")

    def get(self, field: str) -> StackSetting | None:
        return next((s for s in self.settings if s.field == field), None)

    def to_dict(self) -> dict:
        return {"name": self.name, "summary": self.summary, "sources": list(self.sources),
                "settings": {s.field: {"value": s.value, "why": s.why} for s in self.settings}}

    @classmethod
    def from_dict(cls, d: dict, name: str) -> "Stack":
        if not isinstance(d, dict) or not isinstance(d.get("settings"), dict):
            raise v.ConfigError(f"stack={name!r}: must be a JSON object with 'settings' (and 'sources', 'summary')")
        settings = []
        for field, s in d["settings"].items():
            if not isinstance(s, dict) or set(s) != {"value", "why"}:
                raise v.ConfigError(f"stack({name}).settings.{field}: must be {{\"value\": ..., \"why\": \"...\"}}")
            settings.append(StackSetting(field, s["value"], s["why"]))
        sources = d.get("sources", [])
        if not isinstance(sources, list) or not all(isinstance(x, str) for x in sources):
            raise v.ConfigError(f"stack({name}).sources: must be a list of strings")
        return cls(str(d.get("name", name)), str(d.get("summary", "")), tuple(sources), tuple(settings))


def _check_value(o: str, field: str, value) -> None:
    choices = {"attention": ATTENTION, "grad_dtype": GRAD_DTYPES, "grad_accumulation": GRAD_ACCUMULATION,
               "tp_transport": TRANSPORTS, "weights": WEIGHTS}
    if field in choices:
        v.one_of(o, field, value, choices[field])
    elif field in ("pp_scatter_gather", "dp_in_drain", "eager"):
        v.boolean(o, field, value)
    elif field == "bucket_mb" and value != MEGATRON_CORE_BUCKETS:
        v.finite(o, field, value)
    elif field == "zero3_prefetch" and value != "auto":
        positive_int(value, f"{o}.{field}", minimum=0, error=v.ConfigError)
    elif field == "zero3_wrap":
        v.positive_int(o, field, value)


def stack_names() -> list[str]:
    """The stacks shipped with overlapkit, by name."""
    folder = resources.files("overlapkit.costmodel").joinpath("data/stacks")
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".json"))


def load_stack(spec: str) -> Stack:
    """A shipped stack by name, or a JSON file of the same format."""
    if spec in stack_names():
        text = resources.files("overlapkit.costmodel").joinpath(f"data/stacks/{spec}.json").read_text()
        return Stack.from_dict(json.loads(text), spec)
    path = Path(spec)
    if path.suffix == ".json" or path.exists():
        if not path.is_file():
            raise v.ConfigError(f"stack={spec!r}: no such file")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise v.ConfigError(f"stack={spec!r}: not valid JSON ({e.msg} at line {e.lineno})") from None
        return Stack.from_dict(data, path.stem)
    raise v.ConfigError(f"stack={spec!r}: unknown; known stacks: {', '.join(stack_names())} (or a path to a JSON file)")


@dataclass(frozen=True)
class Assumption:
    """A setting the run did not give, the value used and where it came from."""

    setting: str
    """The plan setting (the flag's destination: grad_dtype, bucket_mb, global_batch, ...)."""
    value: object
    """The value used."""
    source: str
    """'stack NAME', 'overlapkit default' or 'model'."""
    why: str
    """The reason, from the stack's file or overlapkit's default table."""

    def to_dict(self) -> dict:
        return {"setting": self.setting, "value": self.value, "from": self.source, "why": self.why}


def fill_defaults(args, stack: Stack | None) -> list[Assumption]:
    """Fill every setting the parsed flags left as None from `stack`, else from DEFAULTS, in place; return
    what was filled. Rules (grad dtype from the parameter dtype, Megatron-Core's bucket size) are resolved
    here, after the dtype and the split are known."""
    filled: list[Assumption] = []
    for field, value, why in DEFAULTS:
        if getattr(args, field, None) is not None:
            continue
        s = stack.get(field) if stack and field in STACK_FIELDS else None
        if s is not None:
            value, why, source = s.value, s.why, f"stack {stack.name}"
        else:
            source = "overlapkit default"
        if field == "grad_dtype":
            value = _grad_dtype(value, args.dtype, args.weights)
        if field == "bucket_mb" and value == MEGATRON_CORE_BUCKETS:
            value = max(40e6, 1e6 * args.dp) * (4 if args.grad_dtype == "fp32" else 2) / 2**20
        setattr(args, field, value)
        filled.append(Assumption(field, value, source, why))
    return filled


def _grad_dtype(rule: str, dtype: str, weights: str = "master") -> str:
    """The reduction dtype a rule gives under the parameter dtype (fp8 GEMMs keep bf16 parameters; autocast's
    parameters are fp32)."""
    if rule == "params":
        return "fp32" if weights == "autocast" else "fp16" if dtype == "fp16" else "bf16"
    if rule == "fp32-for-bf16":
        return "fp16" if dtype == "fp16" else "fp32"
    return rule


@dataclass(frozen=True)
class PlanInputs:
    """What `plan` prices, once the flags, the stack and the defaults are put together."""

    model: "ModelConfig"
    """The model, with --seq-len / --experts / --top-k applied."""
    par: "ParallelConfig"
    """The split, batch and every implementation setting."""
    hardware: str
    """The hardware preset name or file."""
    stack: dict | None
    """The stack named by --stack (Stack.to_dict), or None."""
    assumptions: tuple
    """Every setting the flags left out: its value and where it came from (stacks.Assumption)."""


def assumption_lines(assumptions: list[dict]) -> str:
    """The filled-in settings, one line per origin (the stack's, overlapkit's defaults, the model's)."""
    by: dict[str, list[str]] = {}
    for a in assumptions:
        value = f"{a['value']:.4g}" if isinstance(a["value"], float) else a["value"]
        by.setdefault(a["from"], []).append(f"{a['setting']}={value}")
    return "\n\nassumed (not given):\n" + "\n".join(f"  {k}: {', '.join(x)}" for k, x in by.items()) if by else ""
