"""Pipeline parallelism whose stage-to-stage sends and receives run under other micro-batches'
compute (1F1B, interleaved 1F1B, GPipe as the reference), whose weight-gradient GEMMs fill the
bubble (ZB-H1, ZB-V, DualPipeV) and whose overlapped forward/backward pairs hide each other's
communication (DualPipeV), with data-parallel reduction inside the drain."""

from .engine import PipelineConfig, PipelineEngine, StepTiming
from .schedules import (SCHEDULES, SPLIT_SCHEDULES, V_SCHEDULES, Action, check_schedule, chunks_of, placement,
                        rank_actions, rank_of, rank_slots)
from .stages import SequentialChunk, StageLayout, sequential_chunks, split_layers
from .timetable import ScheduleCost, Timetable, bubble_fraction, price, timetable
from .timing import PipelineTimes, pipeline_times
from .wgrad import WeightGradStore

__all__ = ["PipelineConfig", "PipelineEngine", "StepTiming", "SCHEDULES", "SPLIT_SCHEDULES", "V_SCHEDULES", "Action",
           "check_schedule", "chunks_of", "placement", "rank_actions", "rank_of", "rank_slots",
           "SequentialChunk", "StageLayout", "sequential_chunks", "split_layers", "ScheduleCost",
           "Timetable", "bubble_fraction", "price", "timetable", "PipelineTimes", "pipeline_times", "WeightGradStore"]
