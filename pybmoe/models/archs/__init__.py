"""Architectures of :mod:`pybmoe.models` beyond qwen3moe, one module each.

Each module builds a :class:`pybmoe.models.writer.ArchDef` (tensor plan, metadata, weight init) for one
llama.cpp architecture and registers it with :func:`pybmoe.models.writer.register_arch`; importing this
package imports every module in it, so ``pybmoe make-model --arch NAME`` sees them all.
"""
from __future__ import annotations

import importlib
import pkgutil

for _m in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_m}")
