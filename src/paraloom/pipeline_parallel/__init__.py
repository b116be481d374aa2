"""Pipeline parallelism: schedules as pure data, balanced stage partitions, one runtime for any schedule."""

from paraloom.pipeline_parallel.partition import balance_by_params, balance_by_time, stage_module
from paraloom.pipeline_parallel.runtime import Chunks, PipelineStage, StepStats, split_microbatches
from paraloom.pipeline_parallel.schedules import (
    SCHEDULES,
    Action,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLayers,
    bubble_fraction,
    format_grid,
    make_schedule,
    validate,
)

__all__ = ["SCHEDULES", "Action", "Chunks", "PipelineStage", "Schedule1F1B", "ScheduleGPipe",
           "ScheduleInterleaved1F1B", "ScheduleLayers",
           "StepStats", "balance_by_params", "balance_by_time", "bubble_fraction", "format_grid",
           "make_schedule", "split_microbatches", "stage_module", "validate"]
