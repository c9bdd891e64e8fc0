"""Attention backend registry: which kernel runs behind ``devin::paged_attention``.

A backend implements :class:`devin_compile.step.AttentionBackend`. Selection order: the explicit
``attention_backend`` option, else ``DEVIN_ATTENTION_BACKEND``, else the available
backend with the highest priority for the device. A backend that cannot serve one
particular call (say, logit soft-capping) declines it in :meth:`supports`, and that
call runs on the torch reference, which serves everything and is the test oracle.
"""
from __future__ import annotations

import os

import torch

from ...step import AttentionBackend

_BACKENDS: dict[str, AttentionBackend] = {}


def register_backend(backend: AttentionBackend) -> AttentionBackend:
    _BACKENDS[backend.name] = backend
    return backend


# Modules that register a backend when imported (each checks its own availability lazily).
_BACKEND_MODULES = ("torch_reference", "cpu_sdpa", "flash_attn", "triton_paged")


_loaded = False


def _ensure_loaded() -> None:
    global _loaded
    if _loaded:
        return
    import importlib

    for mod in _BACKEND_MODULES:
        importlib.import_module(f"{__package__}.{mod}")
    _loaded = True


def backend_names() -> list[str]:
    _ensure_loaded()
    return sorted(_BACKENDS)


def get_backend(name: str) -> AttentionBackend:
    _ensure_loaded()
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; valid: {sorted(_BACKENDS)}")
    return _BACKENDS[name]


def select_attention_backend(device: torch.device | str, override: str | None = None) -> AttentionBackend:
    """Pick the backend for ``device`` (see module docstring for the order)."""
    _ensure_loaded()
    device = torch.device(device)
    name = override or os.environ.get("DEVIN_ATTENTION_BACKEND") or None
    if name:
        backend = get_backend(name)
        if not backend.is_available(device):
            raise ValueError(
                f"attention backend {name!r} is not available on {device} "
                f"(available here: {[b.name for b in _BACKENDS.values() if b.is_available(device)]})"
            )
        return backend
    ranked = sorted((b for b in _BACKENDS.values() if b.is_available(device)), key=lambda b: -b.priority)
    return ranked[0]
