"""A tiny plain GPT, built-in plans (GPT, HF Llama), plans translated from transformers' tp_plan, the function that
parallelizes a model after the fact, and its inference layout (prepare_decode, capture_decode_graphs)."""

from .gpt import GPT, GPTConfig, lm_loss
from .parallelize import builtin_plan, expected_local, parallelize, tp_mesh
from .hf_decode import prepare_decode
from .hf_graphs import capture_decode_graphs
from .hf_plans import hf_tp_plan, translate_hf_plan
from .pipeline_chunks import GPTChunk, gpt_chunks
from .plans import gpt_plan, llama_plan

__all__ = ["GPT", "GPTConfig", "lm_loss", "parallelize", "expected_local", "builtin_plan", "tp_mesh",
           "gpt_plan", "llama_plan", "hf_tp_plan", "translate_hf_plan", "GPTChunk", "gpt_chunks",
           "prepare_decode", "capture_decode_graphs"]
