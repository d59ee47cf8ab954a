"""`overlapkit plan` / `overlapkit bench gemm` through the subcommand module: output and bad input."""

import argparse
import json

import pytest

from overlapkit.costmodel.cli import register
from overlapkit.plan_tools import draw_spans, read_measured


def run(argv, capsys):
    parser = argparse.ArgumentParser(prog="overlapkit")
    register(parser.add_subparsers(dest="command", required=True), draw=draw_spans, calibrate=read_measured)
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
    # exposed = (GEMM + comm) - GEMM per site under overlap none: equal to comm up to rounding
    assert d["step_time_s"] > d["compute_s"] > 0 and d["comm_s"] * (1 + 1e-12) >= d["exposed_comm_s"] >= 0
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


def plan_json(argv, capsys):
    code, out, err = run(["plan", "--json", *argv], capsys)
    assert code == 0, err
    return json.loads(out)


def test_megatron_spellings_are_aliases(capsys):
    ours = plan_json(["--model", "llama3-70b", "--tp", "8", "--pp", "2", "--dp", "2", "--global-batch", "8",
                      "--overlap-dp", "bulk", "--zero", "1", "--grad-dtype", "fp32", "--dtype", "fp16"], capsys)
    theirs = plan_json(["--model", "llama3-70b", "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size",
                        "2", "--data-parallel-size", "2", "--global-batch-size", "8", "--overlap-grad-reduce",
                        "--use-distributed-optimizer", "--accumulate-allreduce-grads-in-fp32", "--fp16"], capsys)
    assert theirs["step_time_s"] == ours["step_time_s"]
    assert theirs["parallel"]["grad_bytes"] == 4 and theirs["parallel"]["dtype"] == "fp16"
    assert theirs["parallel"]["overlap"]["dp"] == "bulk" and theirs["parallel"]["zero"] == 1


def test_every_new_flag_reaches_the_prediction(capsys):
    base = ["--model", "llama3-8b", "--tp", "8", "--dp", "2", "--global-batch", "4"]
    ref = plan_json(base, capsys)["step_time_s"]
    for extra in (["--cp", "2"], ["--attention", "unfused"], ["--eager"], ["--recompute", "op"],
                  ["--grad-dtype", "fp32"], ["--seq-len", "4096"], ["--bucket-mb", "1"],
                  ["--grad-accumulation", "hook"], ["--no-gradient-accumulation-fusion"], ["--weights", "autocast"],
                  ["--grad-accumulation", "kept"], ["--stack", "pytorch-amp"]):
        d = plan_json(base + extra, capsys)
        assert d["step_time_s"] != ref, extra
    pp = ["--model", "llama3-8b", "--tp", "8", "--pp", "4", "--dp", "2", "--global-batch", "16", "--no-sp"]
    assert plan_json(pp + ["--pp-scatter-gather"], capsys)["by_kind"]["pp_send"]["comm_s"] < \
        plan_json(pp, capsys)["by_kind"]["pp_send"]["comm_s"]
    uneven = plan_json(pp + ["--decoder-first-pipeline-num-layers", "6", "--decoder-last-pipeline-num-layers", "10"], capsys)
    assert uneven["stage_layers"] == [6, 8, 8, 10]
    z3 = plan_json(["--model", "llama3-8b", "--dp", "8", "--zero", "3", "--overlap", "auto", "--recompute", "full",
                    "--zero3-prefetch", "2", "--zero3-wrap", "4"], capsys)
    assert z3["zero3"]["prefetch"] == 2 and z3["zero3"]["units"] == 8
    moe = plan_json(["--model", "llama3-8b", "--dp", "8", "--ep", "8", "--experts", "8", "--top-k", "2",
                     "--overlap-ep", "pipelined", "--moe-chunks", "8"], capsys)
    assert moe["by_kind"]["ep_all_to_all"]["comm_s"] > 0
    assert next(r for r in moe["layer_rows"] if r.get("comm") == "ep_all_to_all")["chunks"] == 8


def test_plan_prints_throughput_memory_and_pipeline(capsys):
    code, out, _ = run(["plan", "--model", "llama3-70b", "--tp", "8", "--pp", "4", "--vpp", "2", "--dp", "2",
                        "--global-batch", "32", "--overlap-pp", "bulk", "--flops", "palm"], capsys)
    assert code == 0
    assert "TFLOP/s per GPU, MFU" in out and "palm FLOPs" in out and "memory ~" in out
    assert "pipeline interleaved-1f1b (overlap_p2p on): bubble" in out
    code, out, _ = run(["plan", "--model", "llama3-405b", "--hardware", "h100-sxm"], capsys)
    assert code == 0 and "WARNING: memory" in out and "does not fit the 75 GiB" in out


def test_huggingface_config_as_model(tmp_path, capsys):
    cfg = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
           "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "hidden_act": "silu"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    d = plan_json(["--model", str(tmp_path / "config.json"), "--seq-len", "2048", "--tp", "2"], capsys)
    assert d["model"] == tmp_path.name and d["layers_per_stage"] == 16


def _hardware_file(tmp_path, change):
    from overlapkit.costmodel import preset

    d = preset("h200-sxm").to_dict()
    change(d)
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(d))
    return str(path)


@pytest.mark.parametrize("change,field", [
    (lambda d: d["intra"].update(alpha_us=float("inf")), "alpha_us=inf: must be a finite number"),
    (lambda d: d.pop("sm_count"), "missing key(s) sm_count"),
    (lambda d: d.update(gemm=[1, 2]), "hardware.gemm=[1, 2]: must be a JSON object"),
    (lambda d: d["intra"].update(bandwidth_gbps=float("nan")), "bandwidth_gbps=nan"),
])
def test_bad_hardware_files_are_one_line(tmp_path, capsys, change, field):
    code, out, err = run(["plan", "--model", "llama3-8b", "--tp", "8", "--hardware", _hardware_file(tmp_path, change)],
                         capsys)
    assert code == 2 and out == "" and err.count("\n") == 1 and field in err


@pytest.mark.parametrize("content,field", [
    ("[1, 2]", "must be a JSON object, not list"),
    ('{"hidden": 4096, "ffn_hidden": 14336, "num_layers": 32, "num_heads": 32, "seq_len": 4096, '
     '"vocab_size": 128256, "gated_mlp": "no"}', "gated_mlp='no': must be true or false"),
    ('{"hidden": 1e12, "ffn_hidden": 14336, "num_layers": 32, "num_heads": 32, "seq_len": 4096, "vocab_size": 1}',
     "hidden=1000000000000.0: must be an integer"),
    ('{"hidden": 4096}', "missing key(s) ffn_hidden"),
])
def test_bad_model_files_are_one_line(tmp_path, capsys, content, field):
    (tmp_path / "m.json").write_text(content)
    code, out, err = run(["plan", "--model", str(tmp_path / "m.json")], capsys)
    assert code == 2 and err.count("\n") == 1 and field in err


@pytest.mark.parametrize("argv,field", [
    (["--tp", "abc"], "argument --tp/--tensor-model-parallel-size: invalid int value"),
    (["--bucket-mb", "1e14", "--dp", "2"], "--bucket-mb must be a finite number of MiB > 0 and <= 1048576"),
    (["--tp", str(10**12)], "tp=1000000000000: must be <="),
    (["--attention", "sdpa"], "argument --attention: invalid choice"),
    (["--first-stage-layers", "3"], "first_stage_layers=3 needs pp > 1"),
])
def test_bad_flags_are_one_line(argv, field, capsys):
    with pytest.raises(SystemExit) as e:
        code, _, err = run(["plan", "--model", "llama3-8b", *argv], capsys)
        raise SystemExit(code)
    err = capsys.readouterr().err or err
    assert e.value.code == 2 and err.count("\n") == 1 and field in err


@pytest.mark.parametrize("argv,field", [
    (["--global-batch", "0"], "--global-batch=0 must be an integer >= 1"),
    (["--seq-len", "0"], "--seq-len=0 must be an integer >= 1"),
    (["--seq-len", "-5"], "--seq-len=-5 must be an integer >= 1"),
    (["--experts", "0"], "--experts=0 must be an integer >= 1"),
    (["--top-k", "0"], "--top-k=0 must be an integer >= 1"),
    (["--gpus", "0"], "--gpus=0 must be an integer >= 1"),
    (["--gpus", "-1"], "--gpus=-1 must be an integer >= 1"),
    (["--moe-chunks", "0"], "--moe-chunks=0 must be an integer >= 1"),
    (["--zero3-wrap", "0"], "--zero3-wrap=0 must be an integer >= 1"),
    (["--tp", "0"], "--tp=0 must be an integer >= 1"),
    (["--micro-batch", "-2"], "--micro-batch=-2 must be an integer >= 1"),
    (["--first-stage-layers", "-1"], "--first-stage-layers=-1 must be an integer >= 0"),
    (["--bucket-mb", "-5"], "--bucket-mb must be a finite number of MiB > 0 and <= 1048576 (1 TiB), got -5.0"),
    (["--bucket-mb", "0"], "--bucket-mb must be a finite number of MiB > 0"),
    (["--bucket-mb", "nan"], "--bucket-mb must be a finite number of MiB > 0 and <= 1048576 (1 TiB), got nan"),
    (["--bucket-mb", "inf"], "got inf"),
    (["--zero3-prefetch", "-1"], "--zero3-prefetch must be 'auto', an integer >= 0 (blocks ahead), got -1"),
    (["--zero3-prefetch", "soon"], "--zero3-prefetch must be 'auto', an integer >= 0 (blocks ahead), got 'soon'"),
    (["--global-batch", str(10**21)], "global_batch=1000000000000000000000: must be <="),
])
def test_zero_and_absurd_sizes_are_errors_not_defaults(argv, field, capsys):
    code, out, err = run(["plan", "--model", "llama3-8b", *argv], capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and field in err


def test_given_sizes_reach_the_prediction(capsys):
    d1 = plan_json(["--model", "llama3-8b", "--global-batch", "4", "--seq-len", "2048"], capsys)
    d2 = plan_json(["--model", "llama3-8b", "--global-batch", "8", "--seq-len", "2048"], capsys)
    assert d1["parallel"]["micro_batches"] == 4 and d2["parallel"]["micro_batches"] == 8
    work = [d["compute_s"] - d["optimizer_s"] - d["step_end_s"] for d in (d1, d2)]  # once a step either way
    assert work[1] == pytest.approx(2 * work[0], rel=1e-6)


def test_version_prints_the_package_version(capsys):
    from overlapkit import __version__
    from overlapkit.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"overlapkit {__version__}"


@pytest.mark.parametrize("engine, plan_argv", [
    (lambda: __import__("overlapkit.data_parallel.fsdp", fromlist=["x"]).FullyShardConfig(prefetch=-1),
     ["--zero3-prefetch", "-1"]),
    (lambda: __import__("overlapkit.data_parallel.ddp", fromlist=["x"]).DataParallelConfig(bucket_mb=-5.0),
     ["--bucket-mb", "-5"]),
])
def test_plan_refuses_what_the_engine_refuses_in_its_words(engine, plan_argv, capsys):
    # one validator (vocabulary.check_prefetch / check_bucket_mb) for the engine's config and plan's flag
    with pytest.raises(ValueError) as refused:
        engine()
    code, _, err = run(["plan", "--model", "llama3-8b", *plan_argv], capsys)
    words = str(refused.value).split(" must be ", 1)[1]
    for engine_only in (" or a (forward, backward) pair of them", '"auto" or '):  # what plan's flag cannot take
        words = words.replace(engine_only, "")
    assert code == 2 and words in err, (err, words)


def test_plan_takes_the_prefetch_depth_as_fully_shard_does(capsys):
    common = ["--model", "llama3-8b", "--dp", "8", "--zero", "3", "--overlap", "pipelined"]
    auto, two = plan_json([*common, "--zero3-prefetch", "auto"], capsys), plan_json([*common, "--zero3-prefetch", "2"],
                                                                                     capsys)
    assert two["zero3"]["prefetch"] == 2 and auto["zero3"] == plan_json(common, capsys)["zero3"]


@pytest.mark.parametrize("key, value", [("num_key_value_heads", 0), ("num_key_value_heads", -8), ("head_dim", 0),
                                        ("num_key_value_heads", True)])
def test_a_huggingface_config_with_no_heads_is_refused(tmp_path, capsys, key, value):
    cfg = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
           "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "hidden_act": "silu", key: value}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    code, out, err = run(["plan", "--model", str(tmp_path / "config.json")], capsys)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert f"{key}={value!r}: must be an integer >= 1" in err, err
