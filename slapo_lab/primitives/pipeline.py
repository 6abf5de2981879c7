"""Pipeline parallelism: ``cut_pipeline_stage``.

Slapo's semantics (seed ``002``, ``generate_pipeline_partition``): the marked module is the *last*
module of its stage, and cuts at any depth compose in forward order (T5: cuts after
``encoder.block.11``, ``encoder`` and ``decoder.block.11`` give 4 stages). The cut is recorded on the
tree's metadata (``sch.metadata.primitives["cut_pipeline_stage"]``); the split itself happens when
the pipeline is built (:func:`slapo_lab.pipeline.build_pipeline`).

A cut that cannot be honoured is refused at call time, which needs the forward call order: it is
recorded once, lazily, with forward hooks on a meta-device copy of the model
(:func:`slapo_lab.pipeline.call_order`, cached on the schedule tree). If no example inputs are known
(``slapo_lab.pipeline.set_example_inputs``, or a Hugging Face model's ``dummy_inputs``) or the model
cannot run on meta tensors, only the static checks apply and ``build_pipeline`` checks the rest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..call_order import check_cut
from ..errors import ScheduleError
from ..module_state import module_meta, peek_meta
from .base import Primitive, register_primitive

if TYPE_CHECKING:
    from ..schedule import Schedule


@register_primitive()
class CutPipelineStagePrimitive(Primitive):
    """End a pipeline stage after this module (it becomes the last module of its stage).

    Raises:
        ScheduleError: on the root module; when this module already ends a stage; when the module runs
            more than once per forward pass (itself, or inside a module that runs twice) or never runs;
            when the cut would leave a stage with nothing to run (right after another cut, e.g. after a
            stack's last block *and* after the stack when nothing follows the block; or after the very
            last module of the model).
    """

    name = "cut_pipeline_stage"

    @classmethod
    def check(cls, sch: Schedule) -> None:
        if sch.parent is None:
            raise ScheduleError(
                "Cannot cut a pipeline stage at the root module: cut after one of its submodules."
            )
        meta = peek_meta(sch.mod)
        if meta and meta.cut:
            raise ScheduleError(f"{sch.path} already ends a pipeline stage.")
        if sch.path in sch.metadata.primitives["cut_pipeline_stage"]:
            raise ScheduleError(f"{sch.path} already ends a pipeline stage.")
        check_cut(sch)

    @staticmethod
    def apply(sch: Schedule) -> None:
        CutPipelineStagePrimitive.check(sch)
        module_meta(sch.mod).cut = True
        sch.metadata.primitives["cut_pipeline_stage"].append(sch.path)
