"""ModelInfo: the facts about an HF model that passes and the runtime need, read structurally."""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch

from .errors import UnsupportedModelError
from .mask_probe import mask_shapes
from .recurrent import recurrent_layers


@dataclass
class ModelInfo:
    """Facts about the captured model that passes and the runtime need."""

    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_model_len: int
    dtype: torch.dtype
    device: torch.device
    eos_token_ids: list[int]
    attention_modules: list[str] = field(default_factory=list)  # graph-qualified names, in layer order
    sliding_windows: dict[str, int] = field(default_factory=dict)  # attention module → window (if any)
    # attention module → chunk size C of chunked local attention (Llama 4): the query at position p sees
    # only keys in [floor(p / C)·C, p]; absent or -1: no chunk
    attention_chunks: dict[str, int] = field(default_factory=dict)
    # Multi-head latent attention (DeepSeek-V2/V3): (kv_lora_rank, qk_rope_head_dim). The paged cache
    # then holds one latent plane of kv_lora_rank + qk_rope_head_dim values per token and layer.
    mla: tuple[int, int] | None = None
    # The most tokens one step may pack, when the captured graph holds only up to a bound (a branch the
    # model takes only for short inputs, e.g. XGLM's sinusoidal table; see capture.export); None: any.
    max_step_tokens: int | None = None
    # False when model_info(probe_masks=False) left the mask probe out (sliding_windows/attention_chunks empty).
    masks_probed: bool = True
    # Recurrent layers (Mamba/Mamba2 mixers, gated DeltaNet, RG-LRU; capture/recurrent.py), in the order of the ops'
    # ``layer``: their module paths and each one's state shapes (per sequence, without the slot dimension).
    # With them, ``num_layers`` counts the attention layers only (the paged KV cache's layers).
    recurrent_modules: list[str] = field(default_factory=list)
    recurrent_states: list[tuple[tuple[int, ...], ...]] = field(default_factory=list)

    @property
    def has_recurrent_state(self) -> bool:
        return bool(self.recurrent_modules)

    @property
    def kv_cache_layout(self) -> dict:
        """The paged cache's per-token layout (``KVCacheSpec`` keywords): heads, head size, planes."""
        if self.mla is not None:
            return dict(num_kv_heads=1, head_dim=sum(self.mla), planes=1)
        return dict(num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, planes=2)


def _eos_ids(model) -> list[int]:
    ids = []
    for cfg in (getattr(model, "generation_config", None), model.config):
        e = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        if e is None:
            continue
        ids.extend(e if isinstance(e, (list, tuple)) else [e])
    return sorted(set(int(i) for i in ids))


def _attention_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Decoder attention modules in layer order (class name ending in 'Attention')."""
    return [(n, m) for n, m in model.named_modules()
            if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx")]


def _module_kv_heads(attn: list[tuple[str, torch.nn.Module]], heads: int) -> int | None:
    """KV heads as the attention modules themselves use them, when they say so.

    The config can disagree with the module: Falcon's multi-query attention keeps
    ``config.num_kv_heads == num_attention_heads`` but runs with one KV head. Modules
    expose ``num_key_value_heads`` / ``num_kv_heads`` or ``num_key_value_groups``
    (query heads per KV head); if all layers agree on one value, it wins over the config.
    """
    found = set()
    for _n, m in attn:
        for name in ("num_key_value_heads", "num_kv_heads"):
            v = getattr(m, name, None)
            if isinstance(v, int) and v > 0:
                found.add(v)
                break
        else:
            g = getattr(m, "num_key_value_groups", None)
            if isinstance(g, int) and g > 0 and heads % g == 0:
                found.add(heads // g)
    return found.pop() if len(found) == 1 else None


def _mla_dims(text_cfg) -> tuple[int, int] | None:
    """(kv_lora_rank, qk_rope_head_dim) for a multi-head latent attention config, else None."""
    dims = [getattr(text_cfg, k, None) for k in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")]
    if all(isinstance(d, int) and d > 0 for d in dims):
        return dims[0], dims[1]
    return None


def model_info(model: torch.nn.Module, *, probe_masks: bool = True) -> ModelInfo:
    """Read the facts the compiler needs from an HF model, or say why it is unsupported.

    ``probe_masks=False`` leaves out the one probe forward that reads each layer's mask
    (``sliding_windows`` and ``attention_chunks`` stay empty): for a caller that only needs the
    config's facts now (optimize() before it knows whether the compile cache holds the program)."""
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(model, "forward"):
        raise UnsupportedModelError(
            f"{type(model).__name__} is not a Hugging Face PreTrainedModel (no .config); "
            "pass an AutoModelForCausalLM model"
        )
    if getattr(cfg, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"{type(model).__name__} is an encoder-decoder model; devin-compile compiles decoder-only causal LMs"
        )
    if "logits_to_keep" not in inspect.signature(model.forward).parameters:
        raise UnsupportedModelError(
            f"{type(model).__name__}.forward has no `logits_to_keep` argument, so it is not a "
            "causal-LM head model; load it with AutoModelForCausalLM"
        )
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    needed = ("num_hidden_layers", "num_attention_heads", "hidden_size", "vocab_size")
    missing = [k for k in needed if getattr(text_cfg, k, None) is None]
    if missing:
        raise UnsupportedModelError(f"{type(model).__name__}'s config lacks {missing}; not a decoder LM config")
    heads = text_cfg.num_attention_heads
    attn = _attention_modules(model)
    rec_modules, rec_states = recurrent_layers(model)
    kv_heads = _module_kv_heads(attn, heads) or getattr(text_cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // heads
    param = next(model.parameters())
    shapes = {"m." + n: shape for n, shape in mask_shapes(model, text_cfg, attn).items()} if probe_masks else {}
    return ModelInfo(
        model_type=getattr(cfg, "model_type", type(model).__name__),
        num_layers=len(attn) if rec_modules else text_cfg.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=text_cfg.vocab_size,
        max_model_len=int(getattr(text_cfg, "max_position_embeddings", 0) or getattr(text_cfg, "max_seq_len", 0)
                          or 2048),
        dtype=param.dtype,
        device=param.device,
        eos_token_ids=_eos_ids(model),
        attention_modules=["m." + n for n, _ in attn],
        sliding_windows={n: shape.window for n, shape in shapes.items()},
        attention_chunks={n: shape.chunk for n, shape in shapes.items() if shape.chunk > 0},
        mla=_mla_dims(text_cfg),
        masks_probed=probe_masks,
        recurrent_modules=rec_modules,
        recurrent_states=rec_states,
    )
