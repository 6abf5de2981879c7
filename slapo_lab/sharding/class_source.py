"""The source of a module class's methods, read once per class: what the sharding passes read a class's
attributes and reshapes from (:mod:`slapo_lab.sharding.heads`, :mod:`slapo_lab.sharding.attention_site`).

Parsed with :mod:`ast` from :func:`inspect.getsource`; cached per class (:func:`functools.cache`).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from functools import cache

from torch import nn


@cache
def runtime_methods(cls: type) -> tuple | None:
    """The AST nodes of ``cls``'s methods other than ``__init__``, over the classes of ``cls.__mro__`` below
    ``nn.Module`` (overridden ones included: ``super()`` may call them); None when a class has no source."""
    out = []
    for klass in cls.__mro__:
        if (
            klass in (nn.Module, object)
            or not issubclass(klass, nn.Module)
            or klass.__module__.startswith("torch.")
        ):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            return None
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        out += [
            fn
            for fn in body
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.name != "__init__"
        ]
    return tuple(out)
