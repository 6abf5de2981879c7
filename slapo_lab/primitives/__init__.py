"""Schedule primitives, one file per family, all registered in :mod:`.base`."""
from .base import Primitive, get_primitive, list_primitives, register_primitive  # noqa: F401
from . import tensor_parallel, checkpoint, pipeline, replace, annotate  # noqa: F401  (registration side effects)
