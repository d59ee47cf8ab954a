"""A tiny plain GPT and the function that parallelizes it after the fact."""

from .gpt import GPT, GPTConfig, lm_loss
from .parallelize import ScatterToSequenceParallel, expected_local, parallelize

__all__ = ["GPT", "GPTConfig", "lm_loss", "parallelize", "expected_local", "ScatterToSequenceParallel"]
