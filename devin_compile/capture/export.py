"""Export an HF causal LM as an FX GraphModule over flattened tokens (torch.export, non-strict)."""
from __future__ import annotations

import re
import traceback

import torch
import torch.fx

from ..compile_lock import TRACE_LOCK
from .errors import UnsupportedModelError
from .model_info import ModelInfo, model_info
from .recurrent import recurrent_ops, recurrent_modules


class FlatTokensLM(torch.nn.Module):
    """Wraps an HF causal LM into the flattened-token signature the compiler captures."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.m = model

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, logits_indices: torch.Tensor):
        out = self.m(input_ids=input_ids, position_ids=position_ids, logits_to_keep=logits_indices,
                     use_cache=False, return_dict=True)
        return out.logits


def _culprit(exc: BaseException) -> str:
    """The innermost transformers frame of a failure: which module, which line."""
    frames = traceback.extract_tb(exc.__traceback__)
    for fr in reversed(frames):
        if "transformers" in fr.filename or "/models/" in fr.filename:
            return f"{fr.filename.rsplit('/', 2)[-2]}/{fr.filename.rsplit('/', 1)[-1]}:{fr.lineno} in {fr.name}: {fr.line}"
    fr = frames[-1] if frames else None
    return f"{fr.filename}:{fr.lineno} in {fr.name}" if fr else "unknown location"


def capture(model: torch.nn.Module, *, example_len: int = 8, info: ModelInfo | None = None,
            stack_traces: bool = False) -> tuple[torch.fx.GraphModule, ModelInfo]:
    """Export ``model`` over flattened tokens; returns the GraphModule and :class:`ModelInfo`
    (``info`` from an earlier :func:`model_info` call is reused, with dtype/device refreshed).

    ``stack_traces=True`` keeps each node's Python stack trace in ``meta['stack_trace']`` (for
    dumps); recording them costs about a third of the export time, so it is off by default."""
    if info is None:
        info = model_info(model)
    else:
        param = next(model.parameters())
        info.dtype, info.device = param.dtype, param.device
    model.eval()
    device = info.device
    T = torch.export.Dim("num_tokens", min=2)
    N = torch.export.Dim("num_logits", min=1)
    ids = torch.randint(0, min(info.vocab_size, 100), (1, example_len), device=device)
    pos = torch.arange(example_len, device=device)[None]
    idx = torch.arange(example_len, device=device)
    emit_before = getattr(torch.fx.config, "do_not_emit_stack_traces", None)  # None: this torch has no switch
    if emit_before is not None:
        torch.fx.config.do_not_emit_stack_traces = not stack_traces
    try:
        # Guards on num_tokens that this torch cannot prove become runtime asserts in the graph
        # instead of failing the export. torch 2.11 cannot prove Min(16*T, 32*T) == 16*T (a reshape
        # of GQA's expanded K/V); MPT's sliced ALiBi table asserts T <= max_seq_len. An assert
        # that does not hold fails the step loudly; a specialisation (T fixed) still fails here.
        # A branch valid only up to some T (XGLM grows its sinusoidal table past max_positions + 2
        # tokens) is exported for T up to that bound, which caps the tokens of a step (_bounded_export).
        # Recurrent mixers (capture/recurrent.py) are traced through the recurrent devin:: ops.
        mixers = recurrent_modules(model) if info.has_recurrent_state else []
        with TRACE_LOCK, torch.no_grad(), recurrent_ops(mixers):
            try:
                ep = _export(model, (ids, pos, idx), T, N)
            except Exception as e:  # noqa: BLE001
                ep, info.max_step_tokens = _bounded_export(model, (ids, pos, idx), e)
    except Exception as e:  # noqa: BLE001  (any capture failure becomes one clear error)
        msg = str(e).strip().splitlines()
        first = msg[0] if msg else type(e).__name__
        raise UnsupportedModelError(
            f"could not capture {type(model).__name__} ({info.model_type}) with torch.export: "
            f"{type(e).__name__}: {first}\n  at {_culprit(e)}\n"
            "Way out: load the model with attn_implementation='sdpa' or 'eager', make sure it runs "
            "with use_cache=False on position_ids alone, or file the construct as unsupported."
        ) from e
    finally:
        if emit_before is not None:
            torch.fx.config.do_not_emit_stack_traces = emit_before
    gm = ep.module()
    _strip_export_guards(gm)
    return gm, info


def _export(model: torch.nn.Module, example: tuple, T: object, N: object) -> torch.export.ExportedProgram:
    return torch.export.export(FlatTokensLM(model), example, dynamic_shapes=({1: T}, {1: T}, {0: N}), strict=False,
                               prefer_deferred_runtime_asserts_over_guards=True)


def _bounded_export(model: torch.nn.Module, example: tuple, first: Exception) -> tuple[object, int]:
    """Export again letting torch infer the token count's range, when the first export failed only
    because a branch holds up to some number of tokens: (the program, that bound). Any other outcome
    (another error, a fixed token count, a lower bound above 2, no upper bound) re-raises ``first``."""
    if "Constraints violated" not in str(first):
        raise first
    dyn = torch.export.Dim.DYNAMIC
    try:
        ep = _export(model, example, dyn, dyn)
    except Exception:  # noqa: BLE001
        raise first from None
    ids = next(n for n in ep.graph.nodes if n.op == "placeholder" and n.name == "input_ids")
    size = ids.meta["val"].shape[1]
    ranges = ep.range_constraints.get(size.node.expr) if isinstance(size, torch.SymInt) else None
    if ranges is None or int(ranges.lower) > 2 or not str(ranges.upper).isdigit():  # int_oo: no bound
        raise first
    return ep, int(str(ranges.upper))


def _strip_export_guards(gm: torch.fx.GraphModule) -> None:
    """Drop ``_guards_fn`` (export's input-shape guard module): the runtime owns input checks."""
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            gm.graph.erase_node(node)
    if hasattr(gm, "_guards_fn"):
        delattr(gm, "_guards_fn")
    gm.graph.lint()
    gm.recompile()


def module_path_of(node: torch.fx.Node, pattern: str = r"\.layers\.\d+\.[A-Za-z_]*attn[A-Za-z_]*$",
                   among: "set[str] | list[str] | None" = None) -> str | None:
    """The innermost module (from export's nn_module_stack) whose path is in ``among`` (when
    given, e.g. ``ModelInfo.attention_modules``; this works whatever the layers are called:
    ``h.0.attn``, ``layers.0.attention``) or else matches ``pattern``."""
    stack = node.meta.get("nn_module_stack") or {}
    found = None
    wanted = set(among) if among is not None else None
    for path, _cls in stack.values():
        path = path.replace("L['self'].", "").replace("L__self__.", "")
        if (path in wanted) if wanted is not None else re.search(pattern, path):
            found = path
    return found
