"""optimize(): capture → PassManager → runtime.Engine → OptimizedModel."""
from __future__ import annotations

import copy
import json
import time
from typing import Any

import torch

from .backends.attention.registry import get_backend, select_attention_backend
from .capture import ModelInfo, capture, model_info
from .config import OptimizeConfig, SpeculativeConfig
from .passes import default_passes
from .passes.offload_embeddings import check_offload_layers
from .pipeline import PassContext, PassManager, Probe, Program
from .optimized_model import OptimizedModel
from .runtime.engine import Engine
from .runtime.kv_cache import KVCacheSpec, PagedKVCache, blocks_for_budget
from .runtime.kv_prune import active_config as active_kv_prune
from .runtime.kv_tiers import KVTiers
from .runtime.model_runner import ModelRunner
from .runtime.scratch import scratch_step, scratch_steps
from .runtime.speculative import SpeculativeDecoder
from .speculation import build_proposer


def make_probe(info: ModelInfo, device: torch.device, length: int = 12) -> Probe:
    """A fixed one-sequence input run through the program's (prefill) graph on a scratch cache."""
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, info.vocab_size, (1, length), generator=g).to(device)
    pos = torch.arange(length, device=device)[None]
    idx = torch.arange(length, device=device)

    def probe(program: Program) -> torch.Tensor:
        gm = program.graphs.get("prefill") or program.main
        with scratch_step(info, device, [length], backend=get_backend("torch_reference")):
            return gm(ids, pos, idx)

    return probe


def optimize(model: torch.nn.Module, tokenizer=None, **options: Any) -> OptimizedModel:
    """Compile an HF causal LM into a paged-KV engine. Options: see :class:`OptimizeConfig`."""
    # The one KV-pruning setting: kv_prune= or, inside enable_kv_pruning, its config. It decides
    # whether insert_kv_prune compiles devin::kv_prune nodes and is what the engine gets.
    if "kv_prune" not in options and active_kv_prune() is not None:
        options = {**options, "kv_prune": active_kv_prune()}
    config = OptimizeConfig.from_kwargs(options)
    t0 = time.perf_counter()
    info = model_info(model)  # fail fast on unsupported models, before any copy
    offload_roles = set(check_offload_layers(model, list(config.offload_layers)).values())
    if config.dtype is not None and next(model.parameters()).dtype != config.dtype:
        model = copy.deepcopy(model).to(config.dtype)
    if config.device is not None and next(model.parameters()).device != torch.device(config.device):
        model = model.to(config.device)
    quant = _resolve_quantization(model, tokenizer, config)
    gm, info = capture(model, info=info, stack_traces=config.dump_dir is not None)
    if config.scheduler.max_model_len is not None:
        info.max_model_len = config.scheduler.max_model_len
    program = Program({"main": gm})
    ctx = PassContext(info=info, config=config, scratch_step=scratch_steps(info))
    probe = make_probe(info, info.device) if config.verify else None
    report = PassManager(default_passes(config, offload_roles, quant), dump_dir=config.dump_dir,
                         probe=probe).run(program, ctx)
    spec = KVCacheSpec(info.num_layers, dtype=info.dtype, block_size=config.cache.block_size, **info.kv_cache_layout)
    nblocks = blocks_for_budget(spec, info.device, num_blocks=config.cache.num_blocks,
                                memory_bytes=config.cache.memory_bytes, memory_fraction=config.cache.memory_fraction)
    cache = PagedKVCache(spec, nblocks, info.device)
    backend = select_attention_backend(info.device, config.attention_backend)
    if config.warmup and hasattr(backend, "warm_up"):
        backend.warm_up(dtype=info.dtype, num_kv_heads=info.num_kv_heads, num_heads=info.num_heads,
                        head_dim=info.head_dim)
    runner = ModelRunner(program, cache, vocab_size=info.vocab_size, backend=backend, device=info.device)
    proposers = _proposer_factory(model, tokenizer, info)
    spec = (SpeculativeDecoder(config.speculative, proposers(config.speculative))
            if config.speculative is not None else None)
    engine = Engine(runner, config.scheduler, max_model_len=info.max_model_len, eos_token_ids=info.eos_token_ids,
                    tokenizer=tokenizer, enable_prefix_caching=config.cache.enable_prefix_caching,
                    kv_prune=config.kv_prune, kv_tiers=_kv_tiers(config, model, quant, cache), speculative=spec)
    opt = OptimizedModel(engine, info, config, report, tokenizer, time.perf_counter() - t0,
                         hf_config=getattr(model, "config", None))
    opt.proposer_factory = proposers
    opt.quant_result = quant[0] if quant is not None else None
    opt.precision_table = ctx.outputs.precision_table
    opt.quant_note = ctx.outputs.precision_note
    return opt


def _proposer_factory(model: torch.nn.Module, tokenizer, info: ModelInfo):
    """config → proposer for this target (used at optimize() and by ``OptimizedModel.set_draft``)."""
    def build(spec: SpeculativeConfig):
        return build_proposer(spec, model, tokenizer, compile=optimize, target_vocab=info.vocab_size,
                              target_dtype=info.dtype)

    return build


def _kv_tiers(config: OptimizeConfig, model: torch.nn.Module, quant, pool: PagedKVCache) -> KVTiers | None:
    """The KV tiers under ``pool``, keyed by what the K/V depend on: the weights (a sampled digest),
    the model config, the quantization, and (in :meth:`KVTiers.for_model`) dtype, layout, block size."""
    if not config.kv_cache_tiers:
        return None
    from .cache import sampled_state_dict_digest

    hf = getattr(model, "config", None)
    facts = {k: v for k, v in (hf.to_dict() if hf is not None else {}).items()
             if not k.startswith("_") and k != "transformers_version"}
    quantization = None if quant is None else json.dumps([quant[0].fingerprint, repr(quant[1])], sort_keys=True,
                                                         default=str)
    return KVTiers.for_model(config.kv_cache_tiers, pool, weights_digest=sampled_state_dict_digest(model.state_dict()),
                             quantization=quantization, model_config=json.dumps(facts, sort_keys=True, default=str))


def _resolve_quantization(model: torch.nn.Module, tokenizer, config: OptimizeConfig):
    """(QuantResult, QuantConfig) for the assign_precision pass, or None: quantize now
    (``quantization={...}``) or load a saved artifact (``quantized="dir/"``)."""
    from .quant import QuantConfig, artifact, quantize_for_optimize
    from .quant.result import check_tiers

    if config.quantized is not None:
        result = artifact.load(config.quantized, model)
        merged = {k: v for k, v in result.config.items() if k in {f for f in QuantConfig.__dataclass_fields__}}
        merged.update(config.quantization or {})
        qcfg = QuantConfig.coerce(merged)
        check_tiers(result, qcfg.tiers, f"the artifact {config.quantized}")
        return result, qcfg
    if config.quantization is not None:
        return quantize_for_optimize(model, tokenizer, config.quantization), config.quantization
    return None
