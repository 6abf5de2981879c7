"""Pipeline parallelism: ``cut_pipeline_stage``.

Slapo's semantics (seed ``002``, ``generate_pipeline_partition``): the marked module is the *last*
module of its stage. The cut is recorded on the tree's metadata; the runtime split happens in
``build``.
"""
from __future__ import annotations

from ..errors import ScheduleError
from ..module_state import module_meta, peek_meta
from .base import Primitive, register_primitive


@register_primitive()
class CutPipelineStagePrimitive(Primitive):
    """End a pipeline stage after this module.

    Raises:
        ScheduleError: on the root module, or when this module already ends a stage.
    """

    name = "cut_pipeline_stage"

    @classmethod
    def check(cls, sch) -> None:
        if sch.parent is None:
            raise ScheduleError("Cannot cut a pipeline stage at the root module: cut after one of its submodules.")
        meta = peek_meta(sch.mod)
        if meta and meta["cut"]:
            raise ScheduleError(f"{sch.path} already ends a pipeline stage.")

    @staticmethod
    def apply(sch):
        CutPipelineStagePrimitive.check(sch)
        module_meta(sch.mod)["cut"] = True
        sch.metadata.primitives["cut_pipeline_stage"].append(sch.path)
