"""Which stack each published source ran and what it states beyond cases.json: the one place
benchmarks/model_vs_published.py takes its per-source `overlapkit plan` flags from (printed under its table).

Each source names a stack (src/overlapkit/costmodel/data/stacks/NAME.json: the framework's own settings,
each with the code or document it comes from) and the flags of its stated configuration, each with the
sentence, table or script that states it. Nothing here is chosen to fit a published number: a setting that
a source does not state and its stack does not document is left to the stack or to overlapkit's default,
and `plan --json` lists it under `assumptions`.
"""

INTERLEAVED = ("the README: 'pipeline-parallel communication (enabled by default)' overlapped with computation, "
               "which Megatron-Core does only under the interleaved schedule (arguments.py sets overlap_p2p_comm "
               "False without virtual stages); the depth is not stated: the least > 1 that divides the layers per "
               "stage (23 and 7 layers per stage for 119B and 462B: one layer per virtual stage)")
"""Why the README's pipelined rows are priced interleaved."""

SOURCES = {
    "Narayanan21-T1": dict(
        stack="megatron-2021",
        stated=(("--fp16", "examples/sc21/CONFIG.sh passes --fp16"),),
        per_case={c: (("--grad-accumulation", "autograd"),) for c in ("1.7B", "3.6B", "7.5B", "18B")},
        per_case_why="examples/sc21/run_table_1.sh runs 1.7B-18B with --DDP-impl torch (autograd accumulates "
                     "the micro-batch gradients in param.grad) and 39B-1T with the stack's local DDP"),
    "MegatronLM-README-H100": dict(
        stack="megatron-core-2024", stated=(),
        per_case={"70B": (("--vpp", "2"),), "119B": (("--vpp", "23"),), "177B": (("--vpp", "2"),),
                  "314B": (("--vpp", "2"),), "462B": (("--vpp", "7"),)},
        per_case_why=INTERLEAVED),
    "MegatronLM-README-H100-strong": dict(
        stack="megatron-core-2024", stated=(),
        per_case={"177B@96": (("--vpp", "2"),), "177B@4608": (("--vpp", "2"),)}, per_case_why=INTERLEAVED),
    "Llama3-T4": dict(
        stack="llama3-2024",
        stated=(("--first-stage-layers", "7", "Sec. 3.3.2: one layer fewer on the first and the last stage"),
                ("--last-stage-layers", "7", "(126 layers: 7 + 14 x 8 + 7)"),
                ("--vpp", "2", "Sec. 3.3.2: an interleaved schedule; its depth is not given, 2 is the least")),
        model=dict(num_layers=126), why="Table 4's split; the paper's 126 layers"),
    "MT-NLG-530B": dict(
        stack="deepspeed-2022",
        stated=(("--bf16", "Sec. 2.3: mixed precision with 16-bit bfloat"),)),
    "MegatronCore-MoE": dict(
        stack="megatron-core-2024",
        stated=(("--bf16", "the README: Mixtral 8X7B bf16 training"),)),
    "Korthikanti22-T5": dict(
        stack="megatron-2022",
        stated=(("--bf16", "Sec. 5: bf16 mixed precision"),)),
    "torchtitan-perf": dict(
        stack="torchtitan-2024",
        stated=(("--hardware", "h100-sxm-500w", "the benchmark page: H100 SXM at 500 W with HBM2e"),
                ("--recompute", "op", "the benchmark page: selective activation checkpointing, per op")),
        per_case={c: (("--compile",),) for c in ("8B@8 FSDP+compile", "8B@128 FSDP+compile")},
        per_case_why="the '+compile' rows run with --training.compile"),
}
"""source -> stack, stated flags ((flag, value..., why) tuples), per-case flags, and why."""


def source_flags(source: str, case: str, *, stack: bool = True, interleaved: bool = True) -> list[str]:
    """The `plan` flags a source states beyond cases.json, for one of its cases, with its --stack.

    stack=False leaves the stack out (and the interleaving its behaviour implies); interleaved=False keeps the
    stack but not the README rows' interleaving: the other designs model_vs_published.py measures beside."""
    s = SOURCES[source]
    flags = ["--stack", s["stack"]] if stack else []
    for item in s.get("stated", ()):
        flags += list(item[:-1])
    if stack and interleaved or s.get("per_case_why") != INTERLEAVED:
        for item in s.get("per_case", {}).get(case, ()):
            flags += list(item)
    return flags


def describe(source: str) -> str:
    """One table cell: the stack and every stated flag with its reason."""
    s = SOURCES[source]
    parts = [f"--stack {s['stack']}"]
    parts += [f"{' '.join(item[:-1])} ({item[-1]})" for item in s.get("stated", ())]
    if s.get("per_case"):
        by: dict = {}
        for case, items in s["per_case"].items():
            by.setdefault(" ".join(" ".join(i) for i in items), []).append(case)
        parts.append(", ".join(f"{flags} for {' '.join(cases)}" for flags, cases in by.items())
                     + f" ({s['per_case_why']})")
    if s.get("model"):
        parts.append("model " + ", ".join(f"{k}={v}" for k, v in s["model"].items()))
    return "; ".join(parts)
