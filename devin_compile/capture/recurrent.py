"""Recurrent layers: recognised by structure, checked on a probe, their stateful steps captured as ``devin::`` ops.

Pattern → replacement (applied to the module's ``forward`` only while torch.export traces it):

    Mamba2 mixer (Mamba2Mixer, BambaMixer, GraniteMoeHybridMambaLayer, NemotronHMamba2Mixer, FalconH1Mixer with
    its muP multipliers on in_proj's input and output and y · silu(gate) where it has no norm):
        in_proj → split(gate, xBC, dt) → conv (+ conv state) → split(x, B, C) → SSD scan (+ SSM state)
        → norm(y, gate) → out_proj
    →   in_proj → split → devin::mamba2_scan(xBC, dt, conv/scan weights, layer, sizes) → norm(y, gate)
        → out_proj

    Mamba (v1) mixer (MambaMixer, FalconMambaMixer, JambaMambaMixer):
        in_proj → chunk(x, z) → conv (+ state) → x_proj → split(dt, B, C) [→ dt/B/C norms]
        → dt_proj.weight @ dt → selective scan (+ state) · silu(z) → out_proj
    →   the same with devin::causal_conv1d(x, w, b, layer) and devin::selective_scan(x, dt, A_log, B, C, D, z,
        dt_bias, layer) for the two stateful steps

    gated DeltaNet (Qwen3NextGatedDeltaNet): in_proj_qkvz/ba → the module's head reordering → conv (+ state)
        → split q, k, v → gates g, β → gated delta rule (+ state) → norm(o, z) → out_proj
    →   the same with devin::causal_conv1d and devin::gated_delta_rule(q, k, v, g, β, layer)

    gated short convolution (Lfm2ShortConv): in_proj → chunk(B, C, x) → C · conv(B · x) (+ conv state)
        → out_proj
    →   the same with devin::causal_conv1d(B · x, w, b, layer, silu=False)

    RecurrentGemma recurrent block: act(linear_y) · RG-LRU(conv(linear_x)) → linear_out, the RG-LRU's gates from
        each token (reset at position 0), its scan h_t = a_t·h_{t-1} + x_t (+ state)
    →   the same with devin::causal_conv1d(..., silu=False) and devin::linear_recurrence(a, x, layer)

Why a module-level rewrite and not an FX pattern: HF's torch paths unroll the scans into dozens of nodes whose
shapes (chunk padding, ``segment_sum`` masks, per-token loops) specialise on the example length and differ
between families and releases; what stays stable is the module's structure (its projections, conv, ``A_log``,
gates, norms and sizes), so that is what is recognised. Everything around the stateful steps (linears, gates,
norms) stays in the graph as HF wrote it (the passes still see the linears); the ops read their state slots and
sequence boundaries from the step context as ``devin::paged_attention`` reads its block tables.

Invariants: a module is taken only when it has every attribute its kind names (``_MAMBA2_ATTRS``,
``_MAMBA_ATTRS`` with a 2-D ``A_log``, ``_DELTANET_ATTRS``, ``_RGLRU_ATTRS``, ``_SHORTCONV_ATTRS`` with a 3x wide
``in_proj``) and a SiLU activation where the
kind has one, and when the replacement, run as a 7-token prefill then single-token decode steps over a scratch
state, reproduces the module's own HF forward on a random input (:func:`check_on_probe`); otherwise capture
fails with ``UnsupportedModelError`` naming the module and class. Other recurrent constructs (other layouts,
other mixers) are refused by name (``_REFUSED``).
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
_RGLRU_ATTRS = ("linear_y", "linear_x", "linear_out", "conv_1d", "rg_lru", "act_fn", "lru_width")
_SHORTCONV_ATTRS = ("in_proj", "conv", "out_proj", "conv_kernel_size")
_NAMES = {"mamba2": "Mamba2", "mamba": "Mamba", "gated_deltanet": "gated DeltaNet", "rglru": "RG-LRU",
          "shortconv": "short convolution"}
# Class-name fragments of recurrent layers this compiler does not serve yet, and what they are.
_REFUSED = (("GatedDeltaNet", "a gated DeltaNet layer of another layout (recurrent state)"),
            ("RecurrentBlock", "an RG-LRU recurrent block of another layout (recurrent state)"),
            ("Rglru", "an RG-LRU recurrence outside a recognised block (recurrent state)"),
            ("ShortConv", "a short causal convolution of another layout (conv state)"),
            ("MambaMixer", "Mamba v1 selective scan (recurrent state)"),
            ("Mamba", "a Mamba-style mixer (recurrent state)"),
            ("Mixer", "a state-space mixer (recurrent state)"))
# Modules that hold layers rather than compute one (the refusal names the layer, not what contains it).
_CONTAINERS = ("ForCausalLM", "Model", "DecoderLayer", "Layer", "Norm", "Embeddings", "Cache", "MambaBlock",
               "Mamba2Block")


def mixer_kind(mod: torch.nn.Module) -> str | None:
    """"mamba2" (SSD: scalar A per head, gated norm), "mamba" (v1: A [I, N], x_proj/dt_proj), "gated_deltanet"
    (Qwen3-Next: fused qkvz/ba projections, delta rule over [Hv, Dk, Dv] states), "rglru" (RecurrentGemma's
    recurrent block: conv + RG-LRU), "shortconv" (LFM2's gated short convolution: conv state only), or None."""
    if all(hasattr(mod, a) for a in _RGLRU_ATTRS) and isinstance(mod.conv_1d, torch.nn.Conv1d):
        return "rglru"
    if (all(hasattr(mod, a) for a in _SHORTCONV_ATTRS) and isinstance(mod.conv, torch.nn.Conv1d)
            and isinstance(mod.in_proj, torch.nn.Linear) and mod.in_proj.out_features == 3 * mod.conv.in_channels):
        return "shortconv"
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
    """The model's recurrent layers that :func:`mixer_kind` names, in layer order; ``UnsupportedModelError`` for
    any other recurrent layer."""
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
                    f"{name} ({cls}): {what} is not supported yet; devin-compile serves Mamba and Mamba2 mixers, "
                    "gated DeltaNet and RG-LRU blocks of the layouts transformers writes (alone or beside attention). "
                    "Way out: run this model with transformers directly.")
    return found


def state_shapes(mod: torch.nn.Module) -> tuple[tuple[int, ...], ...]:
    """(conv window [Cd, K-1], recurrent state): [H, P, N] for a Mamba2 mixer, [I, N] for a Mamba one,
    [Hv, Dk, Dv] for a gated DeltaNet, [W] for an RG-LRU block; a short convolution has the window only."""
    kind = mixer_kind(mod)
    if kind == "shortconv":
        return ((mod.conv.in_channels, mod.conv.kernel_size[0] - 1),)
    if kind == "rglru":
        return ((mod.lru_width, mod.conv_1d.kernel_size[0] - 1), (mod.lru_width,))
    k = mod.conv1d.kernel_size[0] - 1
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


def _rglru_inputs(lru: torch.nn.Module, x: torch.Tensor, position_ids: torch.Tensor):
    """RG-LRU's per-token gates, as HF's ``RecurrentGemmaRglru.forward`` computes them before its scan:
    (a, normalised x) with ``h_t = a_t·h_{t-1} + x_t``; a position-0 token resets (a = 0, x not scaled)."""
    B, T, W = x.shape
    reset = position_ids[:, :, None] == 0
    act = x.reshape(B * T, lru.num_attention_heads, lru.block_width).permute(1, 0, 2)
    gate_x = torch.sigmoid(torch.baddbmm(lru.input_gate_bias[:, None, :], act, lru.input_gate_weight)
                           .transpose(0, 1).reshape(B, T, W))
    gate_a = torch.sigmoid(torch.baddbmm(lru.recurrent_gate_bias[:, None, :], act, lru.recurrent_gate_weight)
                           .transpose(0, 1).reshape(B, T, W))
    log_a = -8.0 * gate_a * F.softplus(lru.recurrent_param)
    mult = torch.sqrt(1 - torch.exp(2 * log_a))
    mult = reset + ~reset * mult
    return torch.exp(log_a) * ~reset, x * gate_x * mult.type(x.dtype)


def _rglru_forward(mod: torch.nn.Module, layer: int):
    """RecurrentGemma's recurrent block with ``devin::causal_conv1d(silu=False)`` and ``devin::linear_recurrence``;
    its linears, activation and the RG-LRU gates stay in the graph."""

    def forward(input_states: torch.Tensor, position_ids: torch.Tensor, *args, **kwargs):
        y = mod.act_fn(mod.linear_y(input_states))
        x = torch.ops.devin.causal_conv1d(mod.linear_x(input_states), mod.conv_1d.weight.squeeze(1),
                                          mod.conv_1d.bias, layer, False)
        a, x = _rglru_inputs(mod.rg_lru, x, position_ids)
        h = torch.ops.devin.linear_recurrence(a, x, layer)
        return mod.linear_out(h * y), None

    return forward


def _short_conv_forward(mod: torch.nn.Module, layer: int):
    """LFM2's gated short convolution with its conv as ``devin::causal_conv1d(silu=False)``; the projections and
    the B, C gates stay in the graph (padding needs no mask: padded rows are never in a step)."""

    def forward(hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        b, c, x = mod.in_proj(hidden_states).chunk(3, dim=-1)
        h = torch.ops.devin.causal_conv1d(b * x, mod.conv.weight.squeeze(1), mod.conv.bias, layer, False)
        return mod.out_proj(c * h)

    return forward


def _forward_for(mod: torch.nn.Module, layer: int):
    make = {"mamba2": _mamba2_forward, "mamba": _mamba_forward, "gated_deltanet": _gated_delta_forward,
            "rglru": _rglru_forward, "shortconv": _short_conv_forward}[mixer_kind(mod)]
    return make(mod, layer)


def _mamba2_forward(mod: torch.nn.Module, layer: int):
    """``mod``'s forward with the conv + scan as ``devin::mamba2_scan`` (recurrent layer ``layer``). Falcon-H1's
    muP multipliers (``ssm_in_multiplier`` on the input, ``mup_vector`` on ``in_proj``'s output) and its
    optional norm (``nn.Identity``: ``y · silu(gate)`` instead) are applied as HF does."""
    lo, hi = (float(v) for v in mod.time_step_limit)
    scale_in, mup = getattr(mod, "ssm_in_multiplier", None), getattr(mod, "mup_vector", None)
    gated_norm = not isinstance(mod.norm, torch.nn.Identity)

    def forward(hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        dtype = hidden_states.dtype
        proj = mod.in_proj(hidden_states if scale_in is None else hidden_states * scale_in)
        proj = proj if mup is None else proj * mup
        gate, xbc, dt = proj.split([mod.intermediate_size, mod.conv_dim, mod.num_heads], dim=-1)
        y = torch.ops.devin.mamba2_scan(xbc, dt, mod.conv1d.weight.squeeze(1), mod.conv1d.bias, mod.dt_bias,
                                        mod.A_log, mod.D, layer, mod.num_heads, mod.head_dim, mod.n_groups,
                                        mod.ssm_state_size, mod.chunk_size, lo, hi if hi != float("inf") else -1.0)
        y = mod.norm(y, gate) if gated_norm else y * F.silu(gate)
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


def _call(fwd, x: torch.Tensor, start: int, rglru: bool) -> torch.Tensor:
    """``fwd`` on x [1, n, W] at positions start.. (RecurrentGemma's blocks take positions and return a pair)."""
    if not rglru:
        return fwd(x)
    pos = torch.arange(start, start + x.shape[1], device=x.device)[None]
    return fwd(x, pos, None, use_cache=False)[0]


def _step(fwd, x: torch.Tensor, states: _ProbeStates, context: int, rglru: bool) -> torch.Tensor:
    n = x.shape[1]
    meta = AttentionMetadata.build([n], [context + n], [[0]], list(range(n)), x.device)
    with step_context(StepContext(meta, None, None, None, StateStep(states, [0]))):
        return _call(fwd, x, context, rglru)


def check_on_probe(name: str, mod: torch.nn.Module, tokens: int = 11, prefill: int = 7) -> None:
    """The op-based forward equals ``mod``'s HF forward (no cache) on a random input, as a ``prefill``-token
    chunk then single-token decode steps; else ``UnsupportedModelError`` naming the module."""
    from .. import ops  # noqa: F401

    p = next(mod.parameters())
    gen = torch.Generator().manual_seed(0)
    width = (mod.linear_out if mixer_kind(mod) == "rglru" else mod.out_proj).out_features  # the model width
    x = torch.randn(1, tokens, width, generator=gen).to(p.device, p.dtype)
    tol = 1e-4 if p.dtype == torch.float32 else 3e-2
    try:
        with torch.no_grad():
            rglru = mixer_kind(mod) == "rglru"
            ref = _call(mod, x, 0, rglru).float()
            states, fwd = _ProbeStates(state_shapes(mod), p.device), _forward_for(mod, 0)
            outs = [_step(fwd, x[:, :prefill], states, 0, rglru)]
            outs += [_step(fwd, x[:, t:t + 1], states, t, rglru) for t in range(prefill, tokens)]
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
