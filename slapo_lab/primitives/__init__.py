"""Schedule primitives, one file per family, all registered in :mod:`.base`."""

from . import annotate, checkpoint, pipeline, replace, tensor_parallel  # noqa: F401  (registration side effects)
from .base import Primitive, check_primitive, get_primitive, list_primitives, register_primitive  # noqa: F401
