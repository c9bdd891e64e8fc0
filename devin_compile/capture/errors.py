"""The one error capture raises: the model cannot be compiled (the message names the construct
and a way out)."""
from __future__ import annotations


class UnsupportedModelError(RuntimeError):
    """The model cannot be compiled; the message names the construct and a way out."""
