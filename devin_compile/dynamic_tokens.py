"""``compile_model``: the ``devin`` torch.compile backend on a Hugging Face model, one compile for every
prompt length.

Dynamo fixes which sizes of a graph are symbolic before any backend sees it. By default the first
call is traced for its own sizes and the first call with another prompt length compiles again, for
every length (automatic dynamic shapes). A backend cannot undo that: it receives the graph after the
decision, and the shape guards it would have to drop are Dynamo's. So
``torch.compile(model, backend="devin")`` compiles twice over prompt lengths (a tiny Llama called
with 11, 7, 19, 5, 30 tokens: graphs at 11 and 7, none after). ``dynamic=True`` makes every size and
float attribute symbolic, and under torch 2.13 traced that model's first call twice (two backend
compiles before the first answer).

:func:`compile_model` compiles ``model.forward`` in place (``model(ids)`` and ``model.generate`` both
use it) and adds a forward pre-hook, which runs before Dynamo's frame, that marks the sequence
dimension dynamic on every call (``torch._dynamo.maybe_mark_dynamic``): of the token inputs
(:data:`TOKEN_DIMS`) and of the KV cache's keys and values (``cache`` / ``past_key_values``: an
object with ``layers`` holding ``keys``/``values``, transformers' ``Cache``). The first call then
compiles a graph for every length: one for ``model(ids)`` over any prompt length, and under
``generate`` one prefill and one decode graph. "Maybe": where a model really needs a fixed length,
Dynamo specialises it instead of failing. The first call's total time and graph count are logged
(logger ``devin_compile``, INFO) after the backend's line per graph.
"""
from __future__ import annotations

import inspect
import logging
import time
from typing import Any

import torch

from . import compile_backend

log = logging.getLogger(__name__)

#: Token inputs of a Hugging Face causal LM's forward and the dimension that is the sequence.
TOKEN_DIMS = {"input_ids": 1, "attention_mask": 1, "position_ids": 1, "token_type_ids": 1, "inputs_embeds": 1,
              "labels": 1, "cache_position": 0}
CACHE_ARGS = ("cache", "past_key_values")  # transformers 5 renamed past_key_values to cache


def mark_token_dims(bound: dict[str, Any]) -> int:
    """Mark the sequence dimension of the token inputs and KV cache tensors in ``bound`` (forward's
    arguments by name) dynamic for Dynamo; returns how many tensors it marked."""
    marked = 0
    for name, dim in TOKEN_DIMS.items():
        t = bound.get(name)
        if isinstance(t, torch.Tensor) and t.dim() > dim:
            torch._dynamo.maybe_mark_dynamic(t, dim)
            marked += 1
    for name in CACHE_ARGS:
        for layer in getattr(bound.get(name), "layers", None) or ():
            for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if isinstance(t, torch.Tensor) and t.dim() >= 3:
                    torch._dynamo.maybe_mark_dynamic(t, t.dim() - 2)  # [batch, heads, seq, head_dim]
                    marked += 1
    return marked


class _Compiled:
    """What :func:`compile_model` added to a model: the eager forward, the hooks, the first call's clock."""

    def __init__(self, model: torch.nn.Module, eager_forward) -> None:
        self.model = model
        self.eager_forward = eager_forward
        self.own_forward = "forward" in model.__dict__  # a forward set on the instance, not the class's
        self.names = list(inspect.signature(eager_forward).parameters)
        self.first: tuple[float, int] | None = None  # (start, graphs compiled before) while the first call runs
        self.done = False
        self.handles = [model.register_forward_pre_hook(self.before, with_kwargs=True),
                        model.register_forward_hook(self.after)]

    def before(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        mark_token_dims({**dict(zip(self.names, args)), **kwargs})
        if not self.done:
            self.first = (time.perf_counter(), len(compile_backend.reports))

    def after(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if self.done or self.first is None:
            return
        start, before = self.first
        self.done = True
        log.info("first call of the compiled %s: %d graph(s) compiled in %.1f s (Dynamo's tracing, the passes "
                 "and Inductor); other prompt lengths reuse them", type(module).__name__,
                 len(compile_backend.reports) - before, time.perf_counter() - start)

    def remove(self) -> None:
        """Undo :func:`compile_model`: the eager forward back, the hooks gone."""
        for handle in self.handles:
            handle.remove()
        if self.own_forward:
            self.model.forward = self.eager_forward
        else:
            del self.model.forward


def compile_model(model: torch.nn.Module, *, options: dict | None = None, **compile_kwargs: Any) -> torch.nn.Module:
    """``model.forward = torch.compile(model.forward, backend="devin", options=options, **compile_kwargs)``
    with the sequence dimension marked dynamic on every call (see the module docstring); returns
    ``model``. Calling it again recompiles from the eager forward; :func:`uncompile_model` undoes it."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"compile_model takes a torch.nn.Module (a Hugging Face model), got {type(model).__name__}")
    if "backend" in compile_kwargs:
        raise ValueError("compile_model always compiles with backend='devin'; for another backend call torch.compile")
    uncompile_model(model)
    state = _Compiled(model, model.forward)
    model.forward = torch.compile(state.eager_forward, backend="devin", options=options, **compile_kwargs)
    model._devin_compiled = state
    return model


def uncompile_model(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`compile_model` on ``model`` (nothing if it was not compiled by it); returns ``model``."""
    state = model.__dict__.pop("_devin_compiled", None)
    if state is not None:
        state.remove()
    return model
