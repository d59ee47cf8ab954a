"""`overlapkit demo`: the tiny GPT trained under the engines a user picks, checked against one process.

`gpt` builds, runs and checks each rank (TP, DP, EP, CP, ZeRO-3 compose through `models.parallelize`
and the engines' own wrappers); `pipeline` does it for pp > 1; `checks` compares with the reference.
"""

from .gpt import (DEMO_SCHEDULES, TOLERANCE, DemoConfig, check_world, collectives_by_layer, print_results, run,
                  run_rank, say)

__all__ = ["DemoConfig", "DEMO_SCHEDULES", "TOLERANCE", "check_world", "collectives_by_layer", "print_results",
           "run", "run_rank", "say"]
