"""Recurrent mixers: recognised by structure, checked on a probe, captured as one ``devin::`` op each.

Pattern → replacement (applied to the module's ``forward`` only while torch.export traces it):

    HF Mamba2-style mixer (Mamba2Mixer, BambaMixer, GraniteMoeHybridMambaLayer, NemotronH's, ...):
        in_proj → split(gate, xBC, dt) → causal_conv1d_forward (+ conv state) → split(x, B, C)
        → mamba2_scan_forward (+ SSM state) → norm(y, gate) → out_proj
    →   in_proj → split(gate, xBC, dt) → devin::mamba2_scan(xBC, dt, conv/scan weights, layer, sizes)
        → norm(y, gate) → out_proj

Why a module-level rewrite and not an FX pattern: HF's torch path unrolls the SSD scan into ~60 nodes whose
shapes (chunk padding, the ``segment_sum`` masks) specialise on the example length, and it differs between
families and releases; what stays stable is the module's structure (``in_proj``, ``conv1d``, ``A_log``,
``D``, ``dt_bias``, a gated ``norm``, ``out_proj`` and the sizes), so that is what is recognised. The
linears and the gated norm stay in the graph as HF wrote them (the passes still see them); only the
stateful middle becomes one op, which reads its state slots and sequence boundaries from the step context
as ``devin::paged_attention`` reads its block tables.

Invariants: a module is taken only when it has every attribute named in ``_MAMBA2_ATTRS`` (or
``_MAMBA_ATTRS`` with a 2-D ``A_log``) and a SiLU
activation, and when the replacement, run as a 7-token prefill then single-token decode steps over a
scratch state, reproduces the module's own HF forward on a random input (``_probe``); otherwise capture
fails with ``UnsupportedModelError`` naming the module and class. Any other recurrent construct (gated
DeltaNet, RG-LRU, short convolutions, other mixers) is refused by name (``_REFUSED``).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F

from ..step import AttentionMetadata, StateStep, StepContext, step_context
from .errors import UnsupportedModelError

_MAMBA2_ATTRS = ("in_proj", "conv1d", "A_log", "D", "dt_bias", "norm", "out_proj", "num_heads", "head_dim",
                 "n_groups", "ssm_state_size", "intermediate_size", "conv_dim", "chunk_size", "time_step_limit")
_MAMBA_ATTRS = ("in_proj", "conv1d", "x_proj", "dt_proj", "A_log", "D", "out_proj", "time_step_rank",
                "ssm_state_size", "intermediate_size")
_DELTANET_ATTRS = ("in_proj_qkvz", "in_proj_ba", "conv1d", "dt_bias", "A_log", "norm", "out_proj",
                   "fix_query_key_value_ordering", "num_v_heads", "num_k_heads", "head_k_dim", "head_v_dim", "key_dim",
                   "value_dim", "conv_dim")
_NAMES = {"mamba2": "Mamba2", "mamba": "Mamba", "gated_deltanet": "gated DeltaNet"}
# Class-name fragments of recurrent layers this compiler does not serve yet, and what they are.
_REFUSED = (("GatedDeltaNet", "a gated DeltaNet layer of another layout (recurrent state)"),
            ("RecurrentBlock", "RG-LRU recurrent block (recurrent state)"),
            ("Rglru", "RG-LRU recurrence (recurrent state)"),
            ("ShortConv", "short causal convolution (conv state)"),
            ("MambaMixer", "Mamba v1 selective scan (recurrent state)"),
            ("Mamba", "a Mamba-style mixer (recurrent state)"),
            ("Mixer", "a state-space mixer (recurrent state)"))
# Modules that hold layers rather than compute one (the refusal names the layer, not what contains it).
_CONTAINERS = ("ForCausalLM", "Model", "DecoderLayer", "Layer", "Norm", "Embeddings", "Cache", "MambaBlock",
               "Mamba2Block")


def mixer_kind(mod: torch.nn.Module) -> str | None:
    """"mamba2" (SSD: scalar A per head, gated norm), "mamba" (v1: A [I, N], x_proj/dt_proj), "gated_deltanet"
    (Qwen3-Next: fused qkvz/ba projections, delta rule over [Hv, Dk, Dv] states), or None."""
    if not isinstance(getattr(mod, "conv1d", None), torch.nn.Conv1d):
        return None
    if all(hasattr(mod, a) for a in _MAMBA2_ATTRS):
        return "mamba2"
    if all(hasattr(mod, a) for a in _MAMBA_ATTRS) and mod.A_log.dim() == 2:
        return "mamba"
    if all(hasattr(mod, a) for a in _DELTANET_ATTRS):
        return "gated_deltanet"
    return None


def recurrent_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The model's Mamba / Mamba2 mixers in layer order; ``UnsupportedModelError`` for any other recurrent layer."""
    found = []
    for name, mod in model.named_modules():
        cls = type(mod).__name__
        if mixer_kind(mod) is not None:
            if getattr(mod, "activation", "silu") not in ("silu", "swish"):
                raise UnsupportedModelError(f"{name} ({cls}): Mamba mixer with activation {mod.activation!r}; "
                                            "the recurrent ops serve SiLU only")
            found.append((name, mod))
            continue
        if any(name.startswith(f + ".") for f, _ in found):
            continue
        for frag, what in _REFUSED:
            if frag in cls and not cls.endswith(_CONTAINERS):
                raise UnsupportedModelError(
                    f"{name} ({cls}): {what} is not supported yet; devin-compile serves Mamba and Mamba2 mixers "
                    "(alone or beside attention). Way out: run this model with transformers directly.")
    return found


def state_shapes(mod: torch.nn.Module) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(conv window [Cd, K-1], SSM state): [H, P, N] for a Mamba2 mixer, [I, N] for a Mamba one."""
    k, kind = mod.conv1d.kernel_size[0] - 1, mixer_kind(mod)
    if kind == "mamba2":
        return ((mod.conv_dim, k), (mod.num_heads, mod.head_dim, mod.ssm_state_size))
    if kind == "gated_deltanet":
        return ((mod.conv_dim, k), (mod.num_v_heads, mod.head_k_dim, mod.head_v_dim))
    return ((mod.intermediate_size, k), (mod.intermediate_size, mod.ssm_state_size))


def _mamba_forward(mod: torch.nn.Module, layer: int):
    """A Mamba (v1) mixer's forward with ``devin::causal_conv1d`` and ``devin::selective_scan`` (layer ``layer``);
    Jamba's and FalconMamba's norms on dt, B and C applied where the module has them, as HF does."""
    norms = [getattr(mod, n, None) for n in ("dt_layernorm", "b_layernorm", "c_layernorm")]

    def forward(hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        dtype = hidden_states.dtype
        x, z = mod.in_proj(hidden_states).chunk(2, dim=-1)
        x = torch.ops.devin.causal_conv1d(x, mod.conv1d.weight.squeeze(1), mod.conv1d.bias, layer)
        parts = torch.split(mod.x_proj(x), [mod.time_step_rank, mod.ssm_state_size, mod.ssm_state_size], dim=-1)
        ts, B, C = (p if n is None else n(p) for p, n in zip(parts, norms))
        dt = torch.matmul(ts, mod.dt_proj.weight.t())
        y = torch.ops.devin.selective_scan(x, dt, mod.A_log, B, C, mod.D, z, mod.dt_proj.bias, layer)
        return mod.out_proj(y.to(dtype))

    return forward


def _gated_delta_forward(mod: torch.nn.Module, layer: int):
    """A gated DeltaNet layer's forward with ``devin::causal_conv1d`` and ``devin::gated_delta_rule``; the
    projections, the module's own head reordering, the gates and the gated norm stay as HF wrote them."""

    def forward(hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        q, k, v, z, b, a = mod.fix_query_key_value_ordering(mod.in_proj_qkvz(hidden_states),
                                                            mod.in_proj_ba(hidden_states))
        mixed = torch.cat([x.reshape(x.shape[0], x.shape[1], -1) for x in (q, k, v)], dim=-1)
        mixed = torch.ops.devin.causal_conv1d(mixed, mod.conv1d.weight.squeeze(1), mod.conv1d.bias, layer)
        q, k, v = torch.split(mixed, [mod.key_dim, mod.key_dim, mod.value_dim], dim=-1)
        T = q.shape[1]
        q, k = q.reshape(1, T, -1, mod.head_k_dim), k.reshape(1, T, -1, mod.head_k_dim)
        v = v.reshape(1, T, -1, mod.head_v_dim)
        g = -mod.A_log.float().exp() * F.softplus(a.float() + mod.dt_bias)
        o = torch.ops.devin.gated_delta_rule(q, k, v, g, b.sigmoid(), layer)
        o = mod.norm(o.reshape(-1, o.shape[-1]), z.reshape(-1, z.shape[-1])).reshape(z.shape)
        return mod.out_proj(o.reshape(o.shape[0], o.shape[1], -1))

    return forward


def _forward_for(mod: torch.nn.Module, layer: int):
    kind = mixer_kind(mod)
    make = _mamba2_forward if kind == "mamba2" else _mamba_forward if kind == "mamba" else _gated_delta_forward
    return make(mod, layer)


def _mamba2_forward(mod: torch.nn.Module, layer: int):
    """``mod``'s forward with the conv + scan as ``devin::mamba2_scan`` (recurrent layer ``layer``)."""
    lo, hi = (float(v) for v in mod.time_step_limit)

    def forward(hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        dtype = hidden_states.dtype
        proj = mod.in_proj(hidden_states)
        gate, xbc, dt = proj.split([mod.intermediate_size, mod.conv_dim, mod.num_heads], dim=-1)
        y = torch.ops.devin.mamba2_scan(xbc, dt, mod.conv1d.weight.squeeze(1), mod.conv1d.bias, mod.dt_bias,
                                        mod.A_log, mod.D, layer, mod.num_heads, mod.head_dim, mod.n_groups,
                                        mod.ssm_state_size, mod.chunk_size, lo, hi if hi != float("inf") else -1.0)
        y = mod.norm(y, gate)
        return mod.out_proj(y.to(dtype))

    return forward


@contextlib.contextmanager
def recurrent_ops(mixers: list[tuple[str, torch.nn.Module]]) -> Iterator[None]:
    """Within the block, each mixer's ``forward`` calls the recurrent ``devin::`` ops (for torch.export)."""
    from .. import ops  # noqa: F401  (registers the ops)  # pyflakes: ignore

    try:
        for i, (_n, mod) in enumerate(mixers):
            mod.forward = _forward_for(mod, i)
        yield
    finally:
        for _n, mod in mixers:
            mod.__dict__.pop("forward", None)


class _ProbeStates:
    def __init__(self, shapes, device) -> None:
        self.t = tuple(torch.zeros((1, *s), device=device) for s in shapes)

    def layer(self, i: int) -> tuple[torch.Tensor, ...]:
        return self.t


def _step(fwd, x: torch.Tensor, states: _ProbeStates, context: int) -> torch.Tensor:
    n = x.shape[1]
    meta = AttentionMetadata.build([n], [context + n], [[0]], list(range(n)), x.device)
    with step_context(StepContext(meta, None, None, None, StateStep(states, [0]))):
        return fwd(x)


def check_on_probe(name: str, mod: torch.nn.Module, tokens: int = 11, prefill: int = 7) -> None:
    """The op-based forward equals ``mod``'s HF forward (no cache) on a random input, as a ``prefill``-token
    chunk then single-token decode steps; else ``UnsupportedModelError`` naming the module."""
    from .. import ops  # noqa: F401

    p = next(mod.parameters())
    gen = torch.Generator().manual_seed(0)
    width = mod.out_proj.out_features  # the mixer reads and writes the model width
    x = torch.randn(1, tokens, width, generator=gen).to(p.device, p.dtype)
    tol = 1e-4 if p.dtype == torch.float32 else 3e-2
    try:
        with torch.no_grad():
            ref = mod(x).float()
            states, fwd = _ProbeStates(state_shapes(mod), p.device), _forward_for(mod, 0)
            outs = [_step(fwd, x[:, :prefill], states, 0)]
            outs += [_step(fwd, x[:, t:t + 1], states, t) for t in range(prefill, tokens)]
        ours = torch.cat(outs, dim=1).float()
        err = (ours - ref).abs().max().item() / max(ref.abs().max().item(), 1e-6)
    except Exception as e:  # noqa: BLE001  (a mixer whose parts are called differently: not this pattern)
        err = f"{type(e).__name__}: {e}"
    if isinstance(err, str) or not err <= tol:
        err = err if isinstance(err, str) else f"relative error {err:.2e} > {tol:g}"
        raise UnsupportedModelError(
            f"{name} ({type(mod).__name__}) looks like a {_NAMES[mixer_kind(mod)]} mixer but the recurrent ops do "
            f"not reproduce its forward on a probe ({err}): this family computes something else around "
            "the scan. Way out: run this model with transformers directly, or file the construct.")


def recurrent_layers(model: torch.nn.Module) -> tuple[list[str], list[tuple[tuple[int, ...], ...]]]:
    """(mixer module paths in the graph's naming ``m.<path>``, each one's state shapes), every mixer checked."""
    mixers = recurrent_modules(model)
    for name, mod in mixers:
        check_on_probe(name, mod)
    return ["m." + n for n, _ in mixers], [state_shapes(m) for _n, m in mixers]
