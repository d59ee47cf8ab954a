"""`overlapkit plan --stack`: framework settings by name, the assumptions `plan --json` lists, and the
published-step harness running the same path as the command."""

import json
from pathlib import Path

import pytest

from overlapkit.cli import main
from overlapkit.costmodel import ConfigError
from overlapkit.costmodel.cli import parse_plan_args, plan_inputs, plan_json
from overlapkit.costmodel.stacks import STACK_FIELDS, load_stack, stack_names

BASE = ["--model", "llama3-8b", "--tp", "2", "--pp", "2", "--dp", "2", "--global-batch", "8", "--hardware", "h100-sxm"]


def test_every_shipped_stack_loads_with_sources_and_a_reason_per_setting():
    names = stack_names()
    assert {"megatron-2021", "megatron-2022", "megatron-core-2024", "deepspeed-2022", "torchtitan-2024",
            "llama3-2024"} <= set(names)
    for name in names:
        stack = load_stack(name)
        assert stack.name == name and stack.sources and stack.summary
        assert stack.settings and all(s.field in STACK_FIELDS and len(s.why) > 20 for s in stack.settings)


def test_a_stack_fills_only_what_the_flags_leave_out():
    par = plan_inputs(parse_plan_args(BASE + ["--stack", "megatron-2021"])).par
    assert (par.attention, par.pp_scatter_gather, par.grad_accumulation, par.grad_bytes) == ("unfused", True, "hook", 4)
    par = plan_inputs(parse_plan_args(BASE + ["--stack", "megatron-2021", "--attention", "flash", "--fp16"])).par
    assert par.attention == "flash" and par.grad_bytes == 2  # Megatron reduces fp16 gradients in fp16
    default = plan_inputs(parse_plan_args(BASE)).par
    assert (default.attention, default.grad_bytes, default.bucket_mib) == ("flash", 2, 25.0)


def test_megatron_core_buckets_follow_the_data_parallel_size_and_reduction_dtype():
    par = plan_inputs(parse_plan_args(BASE[:6] + ["--dp", "64", "--stack", "megatron-core-2024"])).par
    assert par.grad_bytes == 4 and par.bucket_mib == pytest.approx(64e6 * 4 / 2**20) and par.dp_in_drain
    par = plan_inputs(parse_plan_args(BASE + ["--stack", "megatron-core-2024", "--grad-dtype", "bf16"])).par
    assert par.grad_bytes == 2 and par.bucket_mib == pytest.approx(40e6 * 2 / 2**20)


def test_plan_json_names_every_assumption_and_where_it_came_from():
    d = plan_json(BASE + ["--stack", "torchtitan-2024", "--zero", "3", "--dtype", "bf16"])
    by = {a["setting"]: a for a in d["assumptions"]}
    assert by["attention"]["value"] == "flash2" and by["attention"]["from"] == "stack torchtitan-2024"
    assert by["grad_dtype"]["value"] == "fp32" and "mixed_precision_reduce" in by["grad_dtype"]["why"]
    assert by["bucket_mb"]["from"] == "overlapkit default" and by["seq_len"] == {
        "setting": "seq_len", "value": 8192, "from": "model", "why": "the model's own sequence length"}
    assert "zero" not in by and "dtype" not in by and "hardware" not in by and "tp" not in by  # given
    assert by["vpp"]["value"] == 1 and by["cp"]["from"] == "overlapkit default"  # sizes left out are assumed too
    assert "global_batch" not in by and d["stack"]["name"] == "torchtitan-2024"
    assert all(a["why"] for a in d["assumptions"])


def test_unknown_stack_is_one_line_naming_the_known_ones(capsys):
    assert main(["plan", *BASE, "--stack", "megatron-1999"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "megatron-1999" in err
    assert all(name in err for name in stack_names())


def test_a_users_own_stack_file_and_its_errors(tmp_path, capsys):
    mine = {"name": "ours", "summary": "s", "sources": ["our launcher"],
            "settings": {"attention": {"value": "unfused", "why": "our kernels materialize the scores"}}}
    (tmp_path / "ours.json").write_text(json.dumps(mine))
    d = plan_json(BASE + ["--stack", str(tmp_path / "ours.json")])
    assert d["parallel"]["attention"] == "unfused" and d["stack"]["name"] == "ours"
    bad = dict(mine, settings={"tp": {"value": 4, "why": "a split is the run's, not the framework's"}})
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ConfigError, match="tp: not a stack setting"):
        plan_json(BASE + ["--stack", str(tmp_path / "bad.json")])
    (tmp_path / "why.json").write_text(json.dumps(dict(mine, settings={"eager": {"value": "yes", "why": "x"}})))
    assert main(["plan", *BASE, "--stack", str(tmp_path / "why.json")]) == 2
    assert "eager='yes'" in capsys.readouterr().err


def test_text_output_lists_the_assumptions(capsys):
    assert main(["plan", *BASE, "--stack", "deepspeed-2022"]) == 0
    out = capsys.readouterr().out
    assert "assumed (not given):" in out and "stack deepspeed-2022: attention=unfused" in out


def test_the_harness_and_the_command_give_the_same_step(mvp, tmp_path, capsys):
    """A published case through benchmarks/model_vs_published.py and through `overlapkit plan --json` with the
    command line the harness records: the same number, because it is the same path."""
    folder = Path(__file__).resolve().parents[1] / "data" / "published_steps"
    cases = json.loads((folder / "cases.json").read_text())["cases"]
    for source in ("Narayanan21-T1", "MegatronLM-README-H100", "torchtitan-perf"):
        case = next(c for c in cases if c["source"] == source and c["pp"] == max(
            x["pp"] for x in cases if x["source"] == source))
        row = mvp.run_case(case)
        argv = mvp.plan_argv(case, str(tmp_path))
        assert argv[-len(mvp.source_flags(source, case["case"])):][:2] == ["--stack", mvp.SOURCES[source]["stack"]]
        assert main(["plan", *argv, "--json"]) == 0
        d = json.loads(capsys.readouterr().out)
        assert d["step_time_s"] == row["predicted_s"] and d["assumptions"]
        assert row["command"].startswith("overlapkit plan --model MODEL.json")


def test_the_pytorch_amp_stack_prices_fp32_parameters_under_autocast():
    par = plan_inputs(parse_plan_args(BASE + ["--stack", "pytorch-amp"])).par
    assert (par.weights, par.grad_bytes, par.grad_accumulation, par.eager) == ("autocast", 4, "autograd", True)
    # torch DDP reduces in the parameters' dtype: fp32 under autocast, whatever the compute dtype
    assert plan_inputs(parse_plan_args(BASE + ["--weights", "autocast", "--stack", "deepspeed-2022"])).par.grad_bytes == 4
    by = {a["setting"]: a for a in plan_json(BASE + ["--stack", "pytorch-amp"])["assumptions"]}
    assert by["weights"] == {"setting": "weights", "value": "autocast", "from": "stack pytorch-amp",
                             "why": load_stack("pytorch-amp").get("weights").why}
    assert {a["setting"]: a["value"] for a in plan_json(BASE)["assumptions"]}["weights"] == "master"
