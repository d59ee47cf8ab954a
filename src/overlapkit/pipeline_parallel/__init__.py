"""Pipeline parallelism whose stage-to-stage sends and receives run under other micro-batches'
compute (1F1B, interleaved 1F1B, GPipe as the reference), with data-parallel reduction inside the drain."""

from .engine import PipelineConfig, PipelineEngine, StepTiming
from .schedules import SCHEDULES, Action, Timetable, bubble_fraction, check_schedule, rank_actions, timetable
from .stages import GPTChunk, SequentialChunk, StageLayout, gpt_chunks, sequential_chunks, split_layers
from .timing import PipelineTimes, pipeline_times

__all__ = ["PipelineConfig", "PipelineEngine", "StepTiming", "SCHEDULES", "Action", "Timetable", "bubble_fraction",
           "check_schedule", "rank_actions", "timetable", "GPTChunk", "SequentialChunk", "StageLayout", "gpt_chunks",
           "sequential_chunks", "split_layers", "PipelineTimes", "pipeline_times"]
