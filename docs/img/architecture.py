"""Draw docs/img/architecture.png: overlapkit's layers, each importing only those below it.

Run from the repository root: python docs/img/architecture.py
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

# (layer, [(box title, contents)]), top first; the order tests/test_architecture.py enforces.
LAYERS = [
    ("tools", [("cli · demos/ · doctor · analyze_tool · plan_tools · probe · launch",
                "compose, print, draw; where the timeline and the cost model meet")]),
    ("models", [("models/", "GPT, parallelize(), plans (GPT, Llama, HF tp_plan), pipeline_chunks,\n"
                            "ring_attention, moe_gpt, hf_decode: the only place engines meet a model")]),
    ("engines", [("tensor_parallel", "chunks < ops < layers"), ("data_parallel", "DDP, ZeRO, FSDP2"),
                 ("expert_parallel", "MoE all-to-all"), ("context_parallel", "ring attention"),
                 ("pipeline_parallel", "1F1B … DualPipeV"), ("inference", "fused decode\nall-reduce · graphs")]),
    ("analysis", [("timeline/", "record() → rec.report(), rec.plot(); trace reading,\ndiagnosis, critical path, plots"),
                  ("costmodel/", "predict T_compute, T_comm, T_exposed;\nchoose overlap (ParallelConfig is a ParallelSizes)")]),
    ("runtime", [("runtime/", "comm (collectives → Handle) · recorder, spans, intervals · groups · agreement ·\n"
                              "timeouts · tuning · deprecation · state (caches, verdicts, the active recorder)")]),
    ("vocabulary", [("vocabulary.py", "ParallelSizes · overlap= modes, their meaning and switch per engine ·\n"
                                      "RENAMED (old spellings) · positive_int  (torch-free)")]),
]
COLORS = {"tools": "#f4d35e", "models": "#ee964b", "engines": "#83c5be", "analysis": "#b8c0ff",
          "runtime": "#adb5bd", "vocabulary": "#dee2e6"}


def draw(path: Path) -> None:
    fig, ax = plt.subplots(figsize=(12, 7.2))
    ax.set_xlim(0, 12)
    ax.set_ylim(0, len(LAYERS) * 1.2)
    ax.axis("off")
    left, width, height = 1.5, 10.3, 0.85
    for i, (layer, boxes) in enumerate(LAYERS):
        y = (len(LAYERS) - 1 - i) * 1.2 + 0.15
        ax.text(0.05, y + height / 2, layer, va="center", ha="left", fontsize=11, weight="bold")
        gap = 0.12
        w = (width - gap * (len(boxes) - 1)) / len(boxes)
        for j, (title, text) in enumerate(boxes):
            x = left + j * (w + gap)
            ax.add_patch(FancyBboxPatch((x, y), w, height, boxstyle="round,pad=0.02,rounding_size=0.08",
                                        fc=COLORS[layer], ec="#333333", lw=1))
            ax.text(x + w / 2, y + height * 0.70, title, ha="center", va="center", fontsize=9.5, weight="bold")
            ax.text(x + w / 2, y + height * 0.32, text, ha="center", va="center", fontsize=7.6)
        if layer == "engines":
            ax.text(left + width / 2, y + height + 0.12, "left to right: an engine may build on those to its left "
                    "(ZeRO on TP, the pipeline on DP), never the reverse", ha="center", fontsize=7.5, style="italic")
        if layer == "analysis":
            mid = left + w + gap / 2
            ax.text(mid, y + height + 0.12, "never import each other: they meet through runtime.spans",
                    ha="center", fontsize=7.5, style="italic")
        if i < len(LAYERS) - 1:
            ax.add_patch(FancyArrowPatch((11.9, y + 0.05), (11.9, y - 0.3), arrowstyle="-|>",
                                         mutation_scale=12, color="#333333"))
    ax.text(11.95, len(LAYERS) * 1.2 - 0.05, "imports\npoint down", ha="right", va="top", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    draw(Path(__file__).with_name("architecture.png"))
