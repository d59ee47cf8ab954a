"""Every benchmark script runs end to end in its --smoke mode (tiny sizes, CPU, results into a temporary
folder); the shell scripts parse and name only files that exist; no script reaches below overlapkit's
public names except through benchmarks/_lib/unexported.py, and none reads ../shared.

Each script runs in a fresh interpreter, imported and its main() called (`python -c`), rather than as
`python script.py`: the script is then a module, which the ranks' server imports once and every rank
forks with (`launch.start_method`), instead of each rank re-running the script's imports. The scripts that
take longer than the rest (SLOW) run when OVERLAPKIT_SMOKE_SLOW=1; the CUDA-only ones (CUDA) run where a GPU
is visible, and elsewhere are checked to refuse with their reason.
"""

from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"

SMOKE = {
    # script: extra arguments after --smoke --out DIR
    "agreement_cost": [], "analyze_corpus": [], "analyze_large": [], "calibrate_validation": [],
    "compiled_host_phases": [], "compiled_step_profile": [], "cp_overlap": [], "dp_host_cost": [], "dp_overhead_probe": [], "dp_overlap": [],
    "ep_grouped_probe": [], "ep_host_cost": [], "ep_overlap": [], "fsdp_overlap": [], "fsdp_twin_phases": [], "lm_head_probe": [], "model_vs_measured": [], "moe_vs_grouped_moe": [], "moe_decode": [],
    "model_vs_published": [], "pp_overlap": [], "pp_step_cost": [], "pp_zero_bubble": [], "profile_step": [],
    "reliability_cost": [], "replicated_params_probe": [], "straggler_path": [], "teardown_repeat": [], "tp_agreement_cost": [],
    "tp_chunk_profile": [], "tp_host_cost": [], "tp_overlap": [], "user_step": [], "infer_step": [],
    # CUDA only
    "cp_kernel_probe": [], "ep_profile": [], "hbm_add_probe": [], "tp_step_gaps": ["--device", "cuda"],
}
EXTRA = {"tp_host_cost --host-only": ("tp_host_cost", ["--host-only", "--world", "2"]),
         "user_step --trainer": ("user_step", ["--trainer"]), "reliability_cost --entry": ("reliability_cost", ["--entry"]), "user_step --pp": ("user_step", ["--pp"]),
         "user_step --moe": ("user_step", ["--moe", "--world", "2", "--ep", "2"]),
         "infer_step --world 2": ("infer_step", ["--world", "2"])}
"""Second smoke runs of a script with another mode."""
CUDA = {"cp_kernel_probe", "ep_profile", "hbm_add_probe", "tp_step_gaps"}
SLOW = {"calibrate_validation", "pp_zero_bubble", "pp_overlap", "teardown_repeat", "agreement_cost", "tp_agreement_cost",
        "compiled_step_profile", "tp_host_cost --host-only", "user_step --trainer", "infer_step --world 2"}
"""Run with OVERLAPKIT_SMOKE_SLOW=1 (about 250 s of CPU more): the heaviest (calibrate_validation spawns 4 ranks
twice, pp_zero_bubble 2 then 4, teardown_repeat forks six runs, pp_overlap times nine schedules), and the
probes whose paths another script in the default set covers (the agreement checks run in every layer;
compiled_step_profile builds user_step's variants). The rest, about 300 s of CPU, is the default: a few
minutes on two cores, most of it interpreters starting (~4 s each with torch and DTensor)."""
PROBES = {"agreement_cost", "calibrate_validation", "compiled_host_phases", "compiled_step_profile", "cp_kernel_probe", "dp_host_cost",
          "dp_overhead_probe", "ep_grouped_probe", "fsdp_twin_phases", "ep_host_cost", "ep_profile", "hbm_add_probe", "lm_head_probe",
          "moe_decode", "moe_vs_grouped_moe", "pp_step_cost", "pp_zero_bubble", "profile_step", "replicated_params_probe", "straggler_path", "teardown_repeat",
          "tp_agreement_cost", "tp_chunk_profile", "tp_host_cost", "tp_step_gaps"}
"""The scripts in benchmarks/probes/: experiments that answered a question (the docs that cite them keep the
answer); the rest, at the top level, are the benchmarks of record."""
MAX_TOP_LEVEL = 13
"""One benchmark of record per engine, the user's training step, serving (infer_step: generate() is a user's path
of record as much as the training step), and the analysis and cost-model checks."""
PUBLIC_PACKAGES = ("tensor_parallel", "data_parallel", "pipeline_parallel", "expert_parallel", "context_parallel",
                   "models", "timeline", "costmodel", "integrations", "inference")
TIMEOUT_S = 300


def _folder(name: str) -> Path:
    return BENCH / "probes" if name in PROBES else BENCH


def _run(name: str, args: list[str], out: Path) -> subprocess.CompletedProcess:
    argv = [str(_folder(name) / f"{name}.py"), "--smoke", "--out", str(out), *args]
    code = (f"import sys; sys.path[:0] = [{str(_folder(name))!r}, {str(BENCH)!r}]; sys.argv = {argv!r}; "
            f"import {name}; raise SystemExit({name}.main())")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)


def _cases():
    for key in [*SMOKE, *EXTRA]:
        marks = [pytest.mark.gpu] if key in CUDA else []
        yield pytest.param(key, marks=marks, id=key)


@pytest.mark.parametrize("key", _cases())
def test_script_runs_in_smoke_mode(key, tmp_path):
    name, args = EXTRA.get(key, (key, SMOKE.get(key, [])))
    if key in SLOW and not os.environ.get("OVERLAPKIT_SMOKE_SLOW"):
        pytest.skip(f"{key}: a slow smoke run (see SLOW); OVERLAPKIT_SMOKE_SLOW=1 runs it")
    import torch

    run = _run(name, args, tmp_path)
    tail = (run.stdout[-1500:] + "\n" + run.stderr[-3000:]).strip()
    if key in CUDA and not torch.cuda.is_available():
        # Here it must refuse, saying why, and write nothing: then it is skipped for that reason.
        assert run.returncode == 2 and "CUDA" in run.stderr, tail
        assert not any(tmp_path.iterdir()), list(tmp_path.iterdir())
        pytest.skip(f"{name}: needs CUDA; says: {run.stderr.strip().splitlines()[-1]}")
    assert run.returncode == 0, f"{name} --smoke exited {run.returncode}:\n{tail}"
    written = [p.name for p in tmp_path.rglob("*") if p.suffix in (".json", ".md")]
    assert written, f"{name} --smoke wrote no result into --out:\n{tail}"


def _python_files() -> list[Path]:
    return sorted(p for p in BENCH.rglob("*.py") if "results" not in p.parts and "data" not in p.parts)


def test_every_script_has_a_smoke_run():
    files = [*BENCH.glob("*.py"), *(BENCH / "probes").glob("*.py")]
    scripts = {p.stem for p in files if "__main__" in p.read_text()}
    assert scripts == set(SMOKE), (f"scripts without a smoke entry: {sorted(scripts - set(SMOKE))}; "
                                   f"entries without a script: {sorted(set(SMOKE) - scripts)}")
    assert {p.stem for p in files} == scripts, "a module that is not a script belongs in benchmarks/_lib"
    assert {p.stem for p in (BENCH / "probes").glob("*.py")} == PROBES
    assert SLOW <= set(SMOKE) | set(EXTRA) and CUDA <= set(SMOKE)


def test_the_top_level_holds_the_benchmarks_of_record_each_cited():
    """A newcomer sees the product: at most MAX_TOP_LEVEL scripts, each in docs/results.md and in
    benchmarks/README.md (what it measures, the command behind each committed table)."""
    top = sorted(p.stem for p in BENCH.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL, f"{len(top)} scripts at the top of benchmarks/: {top}"
    results = (ROOT / "docs" / "results.md").read_text()
    readme = (BENCH / "README.md").read_text()
    assert not [s for s in top if f"benchmarks/{s}.py" not in results], "not cited by docs/results.md"
    assert not [s for s in top if f"{s}.py" not in readme], "not listed in benchmarks/README.md"
    assert [p.name for p in BENCH.glob("*.sh")] == ["device.sh"], "the device runs are benchmarks/device.sh's parts"


def _public(module: str) -> set[str]:
    """The names `module` exports (its __all__)."""
    return set(importlib.import_module(module).__all__)


def test_benchmarks_use_only_public_names_outside_unexported():
    """`from overlapkit[.<package>] import name` with name in that __all__, never an underscore name,
    never a module below a package: what a script needs beyond that goes through _lib/unexported.py."""
    problems = []
    for path in _python_files():
        if path == BENCH / "_lib" / "unexported.py":
            continue
        tree = ast.parse(path.read_text(), str(path))
        bound = set()
        for node in ast.walk(tree):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import):
                for a in node.names:
                    parts = a.name.split(".")
                    if parts[0] == "overlapkit" and (len(parts) > 2 or len(parts) == 2 and parts[1] not in PUBLIC_PACKAGES):
                        problems.append(f"{where}: import {a.name}")
                    if parts[0] == "overlapkit":
                        bound.add(a.asname or parts[0])
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "overlapkit":
                parts = node.module.split(".")
                if len(parts) > 2 or len(parts) == 2 and parts[1] not in PUBLIC_PACKAGES:
                    problems.append(f"{where}: from {node.module} import ...")
                    continue
                public = _public(node.module)
                for a in node.names:
                    if a.name not in public:
                        problems.append(f"{where}: {a.name} is not in {node.module}.__all__")
                    bound.add(a.asname or a.name)
            elif isinstance(node, ast.ImportFrom) and node.module == "_lib.unexported":
                bound.update(a.asname or a.name for a in node.names)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                problems.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value.id}.{node.attr}")
    assert not problems, "below overlapkit's public names (add the name to _lib/unexported.py):\n" + "\n".join(problems)


def test_unexported_names_resolve_and_none_is_private():
    sys.path.insert(0, str(BENCH))
    try:
        unexported = importlib.import_module("_lib.unexported")
        assert not [n for n in unexported.WHERE if n.startswith("_")]
        missing = []
        for name in unexported.WHERE:
            try:
                getattr(unexported, name)
            except (ImportError, AttributeError) as e:
                missing.append(f"{name} ({unexported.WHERE[name]}): {e}")
        assert not missing, "moved or gone: " + "; ".join(missing)
    finally:
        sys.path.remove(str(BENCH))


def test_no_script_reads_the_shared_folder():
    """Inputs live in the repo (tests/data, benchmarks/data): a path through ../shared is a checkout that
    cannot re-run its own results."""
    hits = []
    for path in _python_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and (
                    node.value == "shared" or "../shared" in node.value or "shared/" in node.value.split(" ")[0]):
                hits.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value[:60]!r}")
    assert not hits, hits


SHELL = sorted(BENCH.glob("*.sh"))


@pytest.mark.parametrize("script", SHELL, ids=[p.name for p in SHELL])
def test_shell_script_parses_and_names_only_files_that_exist(script):
    check = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    text = "\n".join(line.split("#", 1)[0] for line in script.read_text().splitlines())  # comments aside
    named = set(re.findall(r"\b((?:benchmarks|tests)/[A-Za-z0-9_./-]*[A-Za-z0-9_])", text))
    named |= {f"benchmarks/{m}" for m in re.findall(r'\$\(dirname "\$0"\)/([A-Za-z0-9_.-]+)', text)}
    named = {n for n in named if not n.startswith(("benchmarks/results", "tests/data"))}
    assert named, f"{script.name} names no script: the pattern no longer finds them"
    missing = sorted(n for n in named if not (ROOT / n).exists())
    assert not missing, f"{script.name} names what does not exist: {missing}"


def test_every_result_the_docs_cite_exists():
    """results/ keeps what the docs cite: a table deleted (or renamed) while a doc still links it fails here.
    A name with a placeholder (`<device>`, `{json,md}`, `*`) is a pattern for what a script writes."""
    texts = [ROOT / "README.md", BENCH / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "src").rglob("*.py")]
    missing = []
    for path in texts:
        for i, line in enumerate(path.read_text().splitlines(), 1):
            for name in re.findall(r"results/([A-Za-z0-9_.\-/]+[A-Za-z0-9_])", line):
                target = BENCH / "results" / name
                if not any(c in line for c in "{*<") and not target.exists() and not list(target.parent.glob(target.name + "*")):
                    missing.append(f"{path.relative_to(ROOT)}:{i}: results/{name}")
    assert not missing, "cited but not in benchmarks/results:\n" + "\n".join(missing)


def test_the_memory_column_counts_what_a_step_holds_at_once_not_what_it_saved():
    """A pipeline holds several micro-batches' activations at once and frees each as its backward runs: the CPU
    memory column is the peak of what is alive, parameters (counted in the state) left out."""
    import torch

    sys.path.insert(0, str(BENCH))
    try:
        memory = importlib.import_module("_lib.memory")
    finally:
        sys.path.remove(str(BENCH))
    lin, x = torch.nn.Linear(16, 16), torch.randn(8, 16, requires_grad=True)

    def one_by_one():  # each micro-batch's backward before the next forward
        for _ in range(2):
            torch.relu(lin(x)).sum().backward()

    def all_forwards_first():
        sum(torch.relu(lin(x)).sum() for _ in range(2)).backward()

    skip = memory.storages(lin.parameters())
    one, two = memory.held_peak_bytes(one_by_one, skip), memory.held_peak_bytes(all_forwards_first, skip)
    assert one == 2 * 8 * 16 * 4  # what the linear saves (x) and the relu (its output); the weight left out
    assert two == one + 8 * 16 * 4  # the second micro-batch's relu output held beside the first's; x once
    assert memory.held_peak_bytes(one_by_one) > one  # the weight counts when not left out
