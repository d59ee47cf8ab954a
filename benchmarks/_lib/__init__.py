"""What the benchmark scripts share, so that they import it and not each other.

- `common`: the device / world / out / smoke arguments, spawning ranks, lining them up and timing
  variants in balanced rounds, the machine's label, writing a result as JSON + a markdown table;
- `ratios`: per-round ratios between variants and the verdict a target reads from them;
- `presets`: the model sizes several scripts run (the Llama shapes come from the cost model's MODEL_PRESETS);
- `tp_layer`, `hf_llama`: the TP layer and the Hugging Face Llama variants two or more scripts time;
- `cp_waits`: why ring attention's transfers wait, from every rank's spans;
- `unexported`: the overlapkit names below the packages' public ones that scripts need, in one table.
"""
