"""bitsandbytes, the quantization engine, imported on first use.

Importing it takes seconds, and it is an optional dependency (the ``qlora`` extra): models that are
not quantized never import it, and a quantized load without it fails with the extra to install.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from nemo_wrap.errors import MissingExtraError


def bitsandbytes_functional() -> ModuleType:
    """``bitsandbytes.functional`` (quantize, dequantize, ``QuantState``)."""
    return _import("bitsandbytes.functional")


def bitsandbytes_root() -> ModuleType:
    """``bitsandbytes`` itself (``matmul_4bit``, with its autograd function)."""
    return _import("bitsandbytes")


def check_bitsandbytes_installed() -> None:
    """Raise :class:`MissingExtraError` unless bitsandbytes can be imported."""
    _import("bitsandbytes")


def _import(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError as error:
        raise MissingExtraError(
            f'quantization_config needs bitsandbytes, which is not installed ({error}): pip install "nemo_wrap[qlora]"'
        ) from error
