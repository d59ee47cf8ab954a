"""`overlapkit analyze` with the cost model joined in: link peaks, `--config` savings, `--what-if overlap=...`.

The trace analysis (`overlapkit.timeline`) and the cost model (`overlapkit.costmodel`) never
import each other; this tools-layer module is where they meet. It lends `analyze` three things
(`timeline.cli.Tools`):

- the link of the trace's GPU: the cost model's hardware preset named by `--hardware`, or picked
  from the GPU name in the trace (GPU_PRESETS), as a `timeline.bandwidth.Links`;
- `--config KEY=VALUE ...`: `costmodel.plan` on the stated job, whose recommendations the
  diagnosis quotes;
- `--what-if overlap=MODE` (or `overlap.tp=pipelined`, ...): the cost model predicts the stated job
  and the changed one; the share of each kind's exposed time the change hides in the model is
  applied to that kind's exposed time on the measured critical path (`timeline.whatif.scaled`).
"""

from __future__ import annotations

import sys
from dataclasses import replace

from .timeline import cli as timeline_cli
from .timeline import whatif
from .timeline.bandwidth import Link, Links

GPU_PRESETS = (("H200", "h200-sxm"), ("H100", "h100-sxm"), ("H800", "h800-sxm"), ("A800", "a800-sxm-80g"),
               ("A100", "a100-sxm-80g"))
"""Substrings of a trace's GPU name -> the cost model's hardware preset."""
CONFIG_INTS = ("tp", "pp", "vpp", "dp", "ep", "cp", "micro_batch", "global_batch", "zero")
ENGINES = ("tp", "dp", "zero", "pp", "ep", "cp")


def hardware_links(gpu_name: str | None, hardware: str | None = None) -> Links | None:
    """The links of a preset name, or of the preset a trace's GPU name picks; None when neither is known."""
    name = hardware
    if not name:
        name = next((preset for needle, preset in GPU_PRESETS if gpu_name and needle in gpu_name.upper()), None)
    if not name:
        return None
    from .costmodel import load_hardware  # only when there is a preset to load

    hw = load_hardware(name)
    return Links(name=hw.name, gpus_per_node=hw.gpus_per_node,
                 intra=Link(hw.intra.name, hw.intra.bandwidth_gbps, hw.intra.alpha_us),
                 inter=Link(hw.inter.name, hw.inter.bandwidth_gbps, hw.inter.alpha_us))


def _config(pairs: list[str], hardware: str | None):
    from .costmodel import ConfigError, Overlap, ParallelConfig

    cfg = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ConfigError(f"config={pair!r}: expected KEY=VALUE")
        cfg[key.replace("-", "_")] = value
    if "model" not in cfg:
        raise ConfigError("config: model=NAME is required (a preset, or a model JSON file)")
    model, hw = cfg.pop("model"), cfg.pop("hardware", hardware or "h200-sxm")
    kwargs = {}
    for key, value in cfg.items():
        if key in CONFIG_INTS:
            try:
                kwargs[key] = int(value)
            except ValueError:
                raise ConfigError(f"config {key}={value!r}: expected an integer") from None
        elif key == "overlap":
            kwargs["overlap"] = Overlap.all(value)
        elif key == "sp":
            kwargs["sp"] = value.lower() in ("1", "true", "yes")
        else:
            raise ConfigError(f"config {key}={value!r}: unknown key; known: model, hardware, overlap, sp, "
                              + ", ".join(CONFIG_INTS))
    return model, hw, ParallelConfig(**kwargs)


def plan_from_config(pairs: list[str], hardware: str | None):
    """The cost model's prediction (with recommendations) for `KEY=VALUE` pairs; ConfigError on bad ones."""
    from .costmodel import plan

    model, hw, par = _config(pairs, hardware)
    return plan(model, hw, par)


def _changed(par, change: str):
    from .costmodel import ConfigError, Overlap

    key, sep, mode = change.partition("=")
    if not sep:
        raise ConfigError(f"--what-if {change!r}: expected overlap=MODE or overlap.ENGINE=MODE")
    if key == "overlap":
        return replace(par, overlap=Overlap.all(mode))
    engine = key.removeprefix("overlap.")
    if not key.startswith("overlap.") or engine not in ENGINES:
        raise ConfigError(f"--what-if {change!r}: expected overlap=MODE or overlap.ENGINE=MODE, ENGINE one of "
                          + ", ".join(ENGINES))
    return replace(par, overlap=replace(par.overlap, **{engine: mode}))


def model_what_if(pairs: list[str], hardware: str | None, change: str, paths) -> dict:
    """The measured step if `change` were made, from the cost model's share of each kind's exposed time it hides."""
    from .costmodel import load_hardware, load_model, predict

    model, hw, par = _config(pairs, hardware)
    hw_, model_ = load_hardware(hw), load_model(model)
    base, alt = predict(model_, par, hw_), predict(model_, _changed(par, change), hw_)
    share = {k: max(0.0, 1 - alt.exposed_by_kind.get(k, 0.0) / v) for k, v in base.exposed_by_kind.items() if v > 0}
    saving = whatif.scaled(paths, share)
    measured = whatif.measured_ms(paths)
    return dict(question=f"{change} (cost model: {base.step_ms:.1f} -> {alt.step_ms:.1f} ms predicted)",
                saving_ms=saving, step_ms=measured - saving, measured_ms=measured,
                hidden_share=share)


class _Tools(timeline_cli.Tools):
    links = staticmethod(hardware_links)
    plan = staticmethod(plan_from_config)
    what_if = staticmethod(model_what_if)


TOOLS = _Tools()


def register(subparsers):
    """Add `analyze` (with the cost model lent) to the package CLI."""
    return timeline_cli.register(subparsers, tools=TOOLS)


def main(argv: list[str] | None = None) -> int:
    return timeline_cli.main(argv, tools=TOOLS)


if __name__ == "__main__":
    sys.exit(main())
