"""`overlapkit plan` / `overlapkit bench gemm` through the subcommand module: output and bad input."""

import argparse
import json

import pytest

from overlapkit.costmodel.cli import register


def run(argv, capsys):
    parser = argparse.ArgumentParser(prog="overlapkit")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    code = args.func(args)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("model,extra", [("llama3-8b", ["--tp", "8", "--dp", "4"]),
                                         ("llama3-70b", ["--tp", "8", "--pp", "4", "--dp", "2", "--global-batch", "32"]),
                                         ("llama3-405b", ["--tp", "8", "--pp", "9", "--dp", "8", "--global-batch", "72"]),
                                         ("gpt3-175b", ["--tp", "8", "--pp", "8", "--vpp", "2", "--dp", "2",
                                                        "--global-batch", "32", "--zero", "1"])])
def test_plan_answers_for_every_preset_as_json(model, extra, capsys):
    code, out, _ = run(["plan", "--model", model, "--hardware", "h100-sxm", "--json", *extra], capsys)
    assert code == 0
    d = json.loads(out)
    assert d["step_time_s"] > d["compute_s"] > 0 and d["comm_s"] >= d["exposed_comm_s"] >= 0
    assert d["layer_rows"] and d["recommendations"]
    assert d["model"] == model and d["hardware"] == "h100-sxm"


def test_plan_text_shows_the_layer_and_the_next_switch(capsys):
    code, out, _ = run(["plan", "--model", "llama3-70b", "--tp", "8", "--dp", "2", "--overlap-tp", "bulk"], capsys)
    assert code == 0
    assert "tp_all_gather" in out and "turn on next:" in out and "overlap tp=bulk, dp=none" in out
    assert "qkv fwd" in out and "fc2 dgrad" in out


def test_plan_reads_model_and_nccl_table_files(tmp_path, capsys):
    (tmp_path / "tiny.json").write_text(json.dumps(dict(hidden=1024, ffn_hidden=4096, num_layers=4, num_heads=16,
                                                        seq_len=2048, vocab_size=32000)))
    table = tmp_path / "ag.txt"
    table.write_text("#  Rank  0 Group\n" * 8 + "1024 256 bf16 none -1 50.0 0 0 0\n1073741824 1 bf16 none -1 90000.0 0 0 0\n")
    code, out, _ = run(["plan", "--model", str(tmp_path / "tiny.json"), "--tp", "8", "--json",
                        "--nccl-table", f"all_gather={table}"], capsys)
    assert code == 0
    rows = [r for r in json.loads(out)["layer_rows"] if r.get("comm") == "tp_all_gather"]
    # 2048*1024*2 bytes, between the table's 1 KiB (50 us) and 1 GiB (90 ms): log-log interpolated
    assert 0.05 < rows[0]["comm_ms"] < 90.0 and rows[0]["comm_ms"] > 1.0


@pytest.mark.parametrize("argv,field", [
    (["--model", "llama3-9b"], "model='llama3-9b': unknown preset"),
    (["--model", "llama3-8b", "--hardware", "b300"], "hardware='b300': unknown preset"),
    (["--model", "llama3-8b", "--tp", "3"], "num_heads=32 is not divisible by tp=3"),
    (["--model", "llama3-70b", "--tp", "8", "--pp", "3"], "num_layers=80 is not divisible by pp*vpp=3"),
    (["--model", "llama3-8b", "--tp", "16"], "tp=16 exceeds gpus_per_node=8 of h200-sxm"),
    (["--model", "llama3-8b", "--tp", "4", "--dp", "3"], "world size tp*cp*pp*dp=12 does not fill whole nodes"),
    (["--model", "llama3-8b", "--tp", "8", "--gpus", "16"], "gpus=16 but tp*cp*pp*dp"),
    (["--model", "llama3-8b", "--dp", "2", "--global-batch", "3"], "global_batch=3 is not divisible"),
    (["--model", "llama3-8b", "--nccl-table", "all_gather"], "expected KIND=FILE"),
])
def test_bad_input_exits_2_with_one_line_naming_the_field(argv, field, capsys):
    code, out, err = run(["plan", *argv], capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and field in err and err.startswith("overlapkit plan: error:")


def test_plan_draws_the_predicted_step_and_layer(tmp_path, capsys):
    png = tmp_path / "plan.png"
    code, _, err = run(["plan", "--model", "llama3-8b", "--tp", "8", "--dp", "2", "--overlap", "auto",
                        "--plot", str(png)], capsys)
    assert code == 0, err
    assert png.stat().st_size > 1000 and (tmp_path / "plan_layer.png").stat().st_size > 1000


def test_bench_gemm_needs_a_gpu(capsys, tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: tests/gpu/test_model_bench_gemm.py runs the measurement")
    code, out, err = run(["bench", "gemm", "--out", str(tmp_path / "hw.json")], capsys)
    assert code == 2 and "needs a CUDA GPU" in err and not (tmp_path / "hw.json").exists()
