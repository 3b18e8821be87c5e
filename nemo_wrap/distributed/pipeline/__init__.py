"""Pipeline parallel: contiguous runs of decoder layers on the ``pp`` ranks, driven by torch's schedules.

:mod:`.layout` decides (pure data) which layers and which ends of the model each stage holds;
:mod:`.stage_model` keeps only those modules in a model built on meta; :mod:`.runtime` holds what a
loaded stage needs at run time (its process groups and torch's ``PipelineStage``/schedules).
"""

from nemo_wrap.distributed.pipeline.layout import SCHEDULES, PipelineOptions, StageLayout, stage_layouts

__all__ = ["SCHEDULES", "PipelineOptions", "StageLayout", "stage_layouts"]
