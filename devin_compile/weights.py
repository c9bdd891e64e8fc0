"""Who holds the weights: the compiled program owns what it reads, and holds each weight once.

- :func:`own_weights`: after the passes, the tensors the program still reads as the model had them
  (an embedding, norm weights, a linear no pass re-laid out) become compact copies, and the model's
  parameters are re-pointed to those copies. So the model keeps working and shares them while the
  caller holds it, and once it is dropped nothing keeps the storage it was loaded into alive: a
  memory-mapped checkpoint (``from_pretrained`` maps safetensors files: one tensor still read from
  the mapping keeps every page of it that compiling touched resident) or a larger buffer a tensor
  was a view of.
- :func:`program_tensors`: the tensors the program's graphs hold, once each.
- :func:`held_tensors`: every tensor reachable from an object (an ``OptimizedModel``), grouped by
  the storage it reads; ``bench/memory.py`` and the tests use it to find weights held twice.
"""
from __future__ import annotations

import gc
import sys
import types
import warnings
from typing import Any, Iterator

import torch

from .pipeline import Program


def program_tensors(program: Program) -> Iterator[tuple[torch.nn.Module, str, torch.Tensor]]:
    """``(owner module, attribute, tensor)`` for every parameter and buffer of the program's graphs
    (a tensor that several graphs share is given once per graph)."""
    for gm in program.graphs.values():
        for module in gm.modules():
            for name, t in list(module._parameters.items()) + list(module._buffers.items()):
                if t is not None:
                    yield module, name, t


def _key(t: torch.Tensor) -> tuple | None:
    """The identity of the values a strided CPU/GPU tensor reads (None for opaque layouts: oneDNN)."""
    if t.layout != torch.strided:
        return None
    return t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype


def own_weights(program: Program, model: torch.nn.Module) -> int:
    """Give the program compact copies of the tensors it shares with ``model`` and re-point the model's
    parameters and buffers to them; returns how many tensors were copied."""
    shared: dict[tuple, list[torch.Tensor]] = {}
    for _, _, t in program_tensors(program):
        key = _key(t)
        if key is not None:
            shared.setdefault(key, []).append(t)
    holders = [t for _, t in model.named_parameters(remove_duplicate=False)]
    holders += [t for _, t in model.named_buffers(remove_duplicate=False)]
    copies: dict[tuple, torch.Tensor] = {}
    for t in holders:
        key = _key(t)
        if key is None or key not in shared:
            continue
        if key not in copies:
            copies[key] = t.detach().clone(memory_format=torch.contiguous_format)
            for pt in shared[key]:
                pt.data = copies[key]
        t.data = copies[key]
    return len(copies)


def _storage_key(t: torch.Tensor) -> tuple:
    if t.layout != torch.strided:
        return ("opaque", id(t))
    return (t.device.type, t.untyped_storage().data_ptr())


def _nbytes(t: torch.Tensor) -> int:
    if t.layout != torch.strided:
        return t.numel() * t.element_size()
    return t.untyped_storage().nbytes()


_SKIP = (type, types.ModuleType, types.BuiltinFunctionType, types.MethodWrapperType)


def held_tensors(root: Any) -> dict[tuple, list[torch.Tensor]]:
    """The real tensors reachable from ``root`` through object references (``gc.get_referents``; fake
    and meta tensors left out; modules, classes and modules' global namespaces not followed — a
    function's globals lead to everything its module can reach —, closures are), by storage: each
    key's list holds the tensor objects that read that storage. Opaque tensors (oneDNN) key by object."""
    with warnings.catch_warnings():  # (reaching deprecated torch attributes warns)
        warnings.simplefilter("ignore")
        return _walk(root)


def _walk(root: Any) -> dict[tuple, list[torch.Tensor]]:
    seen: set[int] = {id(vars(m)) for m in list(sys.modules.values()) if isinstance(m, types.ModuleType)}
    stack = [root]
    found: dict[tuple, list[torch.Tensor]] = {}
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if not isinstance(obj, torch._subclasses.FakeTensor) and obj.device.type != "meta":
                found.setdefault(_storage_key(obj), []).append(obj)
            continue
        if isinstance(obj, _SKIP):
            continue
        stack.extend(gc.get_referents(obj))
    return found


def held_bytes(found: dict[tuple, list[torch.Tensor]]) -> int:
    """Bytes of the storages :func:`held_tensors` found."""
    return sum(_nbytes(ts[0]) for ts in found.values())
