"""Shared fixtures: tiny seeded Hugging Face models of many families, and their HF references.

Every model is built from its transformers config class (nothing is downloaded): 2
layers, hidden 64, 4 query heads and 2 KV heads where the family has GQA, vocab 256,
``max_position_embeddings`` 512, HF's own initialisation with ``initializer_range`` 0.1
(see ``_COMMON``) under ``torch.manual_seed(seed)``. The "sdpa" and "eager" variants of a family carry the
very same weights (the sdpa model loads the eager model's state dict), so one HF eager
reference serves both.

Fixtures:

- ``tiny_model(family, attn_implementation="eager", seed=0)`` → an eval-mode fp32 model
  (cached per session; do not mutate it);
- ``hf_reference`` → ``.logits(family, ids)`` and ``.greedy(family, ids, n)`` from the HF
  eager model, cached per session.

Special token ids are bos=1, eos=2, pad=0; test prompts use ids >= 3.
"""
from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass, field

# Triton decides when it is imported whether its library @jit functions run in the interpreter;
# import it here with TRITON_INTERPRET=1 (unless the caller chose) so that the interpreter tests
# (test_attention_backends, test_kv_prune_triton) pass whatever test module imports it first.
if importlib.util.find_spec("triton") is not None:
    _prev_interpret = os.environ.get("TRITON_INTERPRET")
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import triton  # noqa: E402,F401
    if _prev_interpret is None:
        del os.environ["TRITON_INTERPRET"]

# The compile cache stays off in the suite (and the processes it starts): a test that patches a pass or
# the capture must see it run, not a program an earlier test stored. tests/test_compile_cache.py turns
# it on with compile_cache=<its own folder>.
os.environ.setdefault("DEVIN_COMPILE_CACHE_OFF", "1")

import pytest  # noqa: E402
import torch
import transformers
from packaging.version import Version

VOCAB = 256
BOS, EOS, PAD = 1, 2, 0

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, max_position_embeddings=512, bos_token_id=BOS, eos_token_id=EOS,
               pad_token_id=PAD, tie_word_embeddings=False,
               # std 0.1 rather than HF's 0.02: attention is then peaked enough that a 1% error in the
               # softmax scale, an off-by-one window or a missing soft-cap moves logits by > 1e-2,
               # far above the 1e-4 tolerance (at 0.02 such errors stay below 1e-4).
               initializer_range=0.1, init_std=0.1)
_GQA = dict(num_key_value_heads=2)


@dataclass(frozen=True)
class Family:
    """One family under test: its config overrides and what capture should find in it."""

    name: str  # test id
    model_type: str  # transformers model_type
    config: dict = field(default_factory=dict)
    impls: tuple[str, ...] = ("sdpa", "eager")  # what HF offers for this family
    windows: tuple[int, ...] = (-1, -1)  # expected ModelInfo.sliding_windows per layer
    chunks: tuple[int, ...] = (-1, -1)  # expected ModelInfo.attention_chunks per layer (-1: absent)
    kv_heads: int = 2
    core: bool = False  # also run the chunked-prefill / block_size 4 check

    def config_kwargs(self) -> dict:
        kw = dict(_COMMON)
        kw.update(self.config)
        return kw


def _f(name, model_type=None, *, gqa=True, **kw) -> Family:
    config = dict(_GQA) if gqa else {}
    config.update(kw.pop("config", {}))
    if not gqa:
        kw.setdefault("kv_heads", 4)
    return Family(name, model_type or name, config, **kw)


# DeepSeek MLA shape ratios kept (qk_nope = 2·qk_rope, v = qk_nope, rank = 4·qk_rope), scaled down.
_MLA = dict(kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
            n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, moe_intermediate_size=32,
            n_group=1, topk_group=1, num_key_value_heads=4)

# Mamba2-style hybrid: layer 0 a Mamba2 mixer (2 groups of 2 heads of 16, state 16, conv 4), layer 1 attention;
# chunk 8 so prompts span several scan chunks.
_GRANITE_MAMBA = dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=2, mamba_d_conv=4,
                      mamba_chunk_size=8, mamba_expand=1)
_BAMBA = dict(_GRANITE_MAMBA, attn_layer_indices=[1])
_MAMBA1 = dict(state_size=8, intermediate_size=128, time_step_rank=8)
_FALCON_H1 = dict(mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16,
                  mamba_chunk_size=8, ssm_multipliers=[0.9, 1.2, 0.8, 1.1, 0.7], ssm_in_multiplier=0.6,
                  ssm_out_multiplier=1.3, key_multiplier=0.8, attention_in_multiplier=1.1, attention_out_multiplier=0.9,
                  mlp_multipliers=[1.2, 0.8], embedding_multiplier=1.5, lm_head_multiplier=0.7)

# Families that compile and must match HF. Comments name what each one exercises.
FAMILIES: dict[str, Family] = {f.name: f for f in [
    # --- the core six: full battery, both attention implementations
    _f("llama", core=True),
    _f("mistral", core=True, config=dict(sliding_window=12), windows=(12, 12)),  # window only in config
    _f("qwen2", core=True),  # qkv bias
    _f("qwen3", core=True, config=dict(head_dim=16)),  # q/k RMSNorm
    _f("phi3", core=True),  # fused qkv / gate_up projections
    _f("gemma", core=True, config=dict(head_dim=16)),  # scaled embeddings, (1 + w) RMSNorm
    # --- more families
    _f("gemma2", impls=("eager",), windows=(7, -1),  # HF has no SDPA path for Gemma 2
       config=dict(head_dim=16, sliding_window=7, attn_logit_softcapping=1.0, final_logit_softcapping=5.0,
                   query_pre_attn_scalar=16)),  # attention soft-capping + alternating sliding window
    _f("gemma3_text", windows=(8, -1), config=dict(head_dim=16, sliding_window=8, sliding_window_pattern=2,
                                                   query_pre_attn_scalar=16)),
    _f("qwen2_sliding", "qwen2", windows=(-1, 12),  # sliding window on layers >= max_window_layers
       config=dict(use_sliding_window=True, sliding_window=12, max_window_layers=1)),
    _f("starcoder2", windows=(12, 12), config=dict(sliding_window=12)),
    _f("mixtral", config=dict(num_local_experts=4, num_experts_per_tok=2)),
    _f("qwen3_moe", config=dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16)),
    _f("olmo"),
    _f("olmo2"),  # q/k norm over all heads
    _f("stablelm", config=dict(partial_rotary_factor=0.25)),  # partial rotary
    _f("granite", config=dict(embedding_multiplier=2.0, attention_multiplier=0.3, residual_multiplier=0.5,
                              logits_scaling=2.0)),  # custom attention scale
    _f("smollm3", config=dict(no_rope_layer_interval=2)),  # NoPE layers
    _f("cohere", config=dict(logit_scale=0.5)),  # parallel attention/MLP block, LayerNorm
    _f("cohere2", windows=(12, 12), config=dict(sliding_window=12)),
    _f("phi", gqa=False, config=dict(partial_rotary_factor=0.5)),
    _f("gpt2", gqa=False),  # Conv1D projections, learned positions, h.N.attn naming
    _f("gpt_neox", gqa=False),  # layers.N.attention naming, fused qkv
    _f("falcon", gqa=False, kv_heads=1),  # multi-query: one KV head broadcast in q @ kᵀ; in-place scale
    _f("opt", gqa=False),  # learned positions with offset
    # --- ALiBi (no rotary): per-head slopes read from the bias on a probe, applied by the backends
    _f("bloom", gqa=False, impls=("eager",)),  # baddbmm(alibi, q, kᵀ) over [B·H, T, D], bmm with v
    _f("mpt", gqa=False, impls=("eager",), config=dict(d_model=64, n_heads=4, n_layers=2)),  # sliced table
    _f("falcon_alibi", "falcon", gqa=False, config=dict(alibi=True, multi_query=False)),  # bias in the mask
    # --- multi-head latent attention: the paged cache holds latents (kv_lora_rank + qk_rope_head_dim)
    _f("deepseek_v3", gqa=False, config=_MLA),  # q LoRA, new_empty + copy_ key expansion, MoE after layer 0
    _f("deepseek_v2", gqa=False, config=dict(_MLA, q_lora_rank=None)),  # plain q_proj
    # --- attention sinks: a learned logit per head in the softmax's denominator, read on a probe
    _f("gpt_oss", impls=("eager",), windows=(8, -1),  # HF has no SDPA path for gpt-oss; MoE with clamped SwiGLU
       config=dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=8,
                   layer_types=["sliding_attention", "full_attention"])),
    # --- chunked local attention (rotary layers) beside a NoPE global layer; MoE with a shared expert
    _f("llama4_text", chunks=(8, -1),
       config=dict(attention_chunk_size=8, no_rope_layers=[1, 0], num_local_experts=2, num_experts_per_tok=1,
                   intermediate_size_mlp=128, head_dim=16, interleave_moe_layer_step=1, floor_scale=4)),
    # --- attention spelled another way: query scaled before bmm over [B·H, T, D] views, the mask clamped
    # with max(s, finfo.min), sinusoidal positions (whose table growth caps a step at 512 tokens)
    _f("xglm", gqa=False, impls=("eager",), config=dict(ffn_dim=128)),
    # --- recurrent state (issue 42 part 4): Mamba2 mixers as devin::mamba2_scan over a state pool
    _f("bamba", windows=(-1,), chunks=(-1,), config=_BAMBA),  # Mamba2 mixer + attention (IBM Bamba)
    _f("granitemoehybrid", windows=(-1,), chunks=(-1,),  # Granite 4 style: mixer + attention, shared MLP
       config=dict(_GRANITE_MAMBA, layer_types=["mamba", "attention"], num_local_experts=0)),
    _f("nemotron_h", windows=(-1,), chunks=(-1,),  # mixer and attention blocks named `mixer` alike
       config=dict(layers_block_type=["mamba", "attention"], mamba_num_heads=4, mamba_head_dim=16,
                   ssm_state_size=16, n_groups=2, chunk_size=8)),
    _f("mamba2", gqa=False, impls=("eager",), windows=(), chunks=(),  # pure Mamba2: no attention, no KV layers
       config=dict(num_heads=8, head_dim=16, n_groups=2, state_size=16, chunk_size=8, expand=2)),
    # Mamba v1 mixers: devin::causal_conv1d + devin::selective_scan, x_proj/dt_proj left in the graph
    _f("mamba", gqa=False, impls=("eager",), windows=(), chunks=(), config=_MAMBA1),  # pure Mamba
    _f("falcon_mamba", gqa=False, impls=("eager",), windows=(), chunks=(), config=_MAMBA1),  # weightless dt/B/C norms
    _f("jamba", windows=(-1,), chunks=(-1,),  # Mamba mixer (dt/B/C RMSNorms) + attention
       config=dict(num_experts=1, attn_layer_offset=1, attn_layer_period=2, mamba_d_state=8, mamba_expand=2,
                   mamba_dt_rank=8)),
    # gated DeltaNet (conv + delta rule state) beside gated attention with partial rotary; MoE with shared expert
    _f("qwen3_next", windows=(-1,), chunks=(-1,),
       config=dict(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                   head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                   linear_value_head_dim=16, layer_types=["linear_attention", "full_attention"])),
    # RG-LRU (conv + diagonal linear recurrence, gates from each token) beside local attention (window 12, partial
    # rotary); embeddings scaled by a bf16 sqrt(hidden), logits soft-capped
    _f("recurrent_gemma", windows=(12,), chunks=(-1,),
       config=dict(lru_width=64, attention_window_size=12, block_types=["recurrent", "attention"])),
    # gated short convolution (conv window state only, conv_bias on) beside attention with q/k norms
    _f("lfm2", windows=(-1,), chunks=(-1,), config=dict(layer_types=["conv", "full_attention"], conv_bias=True)),
    # Falcon-H1: a Mamba2 mixer beside attention in every layer (parallel), muP multipliers everywhere (ssm in/out,
    # a per-section vector on in_proj's output, key, attention in/out, MLP, embeddings, lm_head); no gated norm
    # (y · silu(gate)) by default, the gated RMSNorm in the second variant
    _f("falcon_h1", config=_FALCON_H1),
    _f("falcon_h1_norm", "falcon_h1", config=dict(_FALCON_H1, mamba_rms_norm=True)),
]}

# Families that must fail with a clear error rather than compile wrongly. Value:
# (model_type, config overrides, attn_implementation, expected error class name, message regex, why).
UNSUPPORTED: dict[str, tuple] = {}

# Falcon's new decoder architecture (GQA): before transformers 5.25 its attention repeats the KV
# heads by broadcast_to in a [T, Hkv, G, D] layout before the transpose, which capture refuses;
# 5.25 moved it onto the shared attention interface, which compiles and must then match HF.
_FALCON_NEW_ARCH = dict(new_decoder_architecture=True, num_kv_heads=2)
if Version(transformers.__version__) >= Version("5.25"):
    FAMILIES["falcon_new_arch"] = _f("falcon_new_arch", "falcon", gqa=False, kv_heads=2, config=_FALCON_NEW_ARCH)
else:
    UNSUPPORTED["falcon_new_arch"] = ("falcon", _FALCON_NEW_ARCH, "sdpa", "PassError", r"KV heads",
                                      "GQA repeated by broadcast_to in [T, Hkv, G, D] layout before the transpose")


# transformers before 5.25 (the GPU machines' 5.17): Falcon with alibi=True differs from this project's
# ALiBi (eager: HF adds the bias to the scores and again through the mask; SDPA: logits differ by up
# to 0.21 on the tiny config, not yet explained); its cases are expected failures there (not strict:
# greedy tokens may still agree), and they must pass from 5.25 on.
KNOWN_DIFFERENT: dict[str, str] = {}
if Version(transformers.__version__) < Version("5.25"):
    KNOWN_DIFFERENT["falcon_alibi"] = "transformers < 5.25 spells Falcon's ALiBi differently (see conftest)"


def build_config(model_type: str, overrides: dict, attn_implementation: str):
    from transformers import AutoConfig

    kw = dict(_COMMON)
    kw.update(overrides)
    cfg = AutoConfig.for_model(model_type, **kw)
    cfg._attn_implementation = attn_implementation
    return cfg


def build_model(model_type: str, overrides: dict, attn_implementation: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    cfg = build_config(model_type, overrides, attn_implementation)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation, dtype=torch.float32)
    return model.eval()


@functools.lru_cache(maxsize=None)
def _cached_model(family: str, attn_implementation: str, seed: int):
    fam = FAMILIES[family]
    if attn_implementation not in fam.impls:
        raise ValueError(f"{family} has no {attn_implementation!r} attention in transformers (only {fam.impls})")
    if attn_implementation == "eager":
        return build_model(fam.model_type, fam.config_kwargs(), "eager", seed)
    model = build_model(fam.model_type, fam.config_kwargs(), attn_implementation, seed)
    model.load_state_dict(_cached_model(family, "eager", seed).state_dict())  # same weights as the reference
    return model


def _reference(family: str, seed: int = 0):
    """The HF model the tests compare against: eager attention (the math as written)."""
    fam = FAMILIES[family]
    return _cached_model(family, "eager" if "eager" in fam.impls else fam.impls[0], seed)


@pytest.fixture(scope="session")
def tiny_model():
    """Factory: ``tiny_model(family, attn_implementation="eager", seed=0)`` → cached eval fp32 model."""
    def make(family: str, attn_implementation: str = "eager", seed: int = 0):
        return _cached_model(family, attn_implementation, seed)

    return make


class HFReference:
    """HF eager outputs, computed once per (family, ids)."""

    @functools.lru_cache(maxsize=None)
    def _logits(self, family: str, ids: tuple[int, ...]) -> torch.Tensor:
        with torch.no_grad():
            return _reference(family)(torch.tensor([ids])).logits[0]

    @functools.lru_cache(maxsize=None)
    def _greedy(self, family: str, ids: tuple[int, ...], n: int) -> tuple[int, ...]:
        model = _reference(family)
        with torch.no_grad():
            # eos_token_id=None: exactly n greedy tokens, EOS allowed like ignore_eos=True
            # (with an EOS id, min_new_tokens would mask EOS out of the argmax instead).
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                                 pad_token_id=PAD)
        return tuple(out[0, len(ids):].tolist())

    def logits(self, family: str, ids) -> torch.Tensor:
        return self._logits(family, tuple(int(i) for i in ids))

    def greedy(self, family: str, ids, n: int) -> list[int]:
        return list(self._greedy(family, tuple(int(i) for i in ids), n))


@pytest.fixture(scope="session")
def hf_reference() -> HFReference:
    return HFReference()


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny matmuls gain nothing from threads, and OpenMP barriers on a busy 2-core box cost ms each."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
