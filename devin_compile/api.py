"""optimize(): capture → PassManager → runtime.build_engine → OptimizedModel (assembly only)."""
from __future__ import annotations

import copy
import dataclasses
import logging
import os
import time
from typing import Any

import torch

from .backends.attention.registry import get_backend
from .capture import ModelInfo, capture, model_info
from .config import OptimizeConfig
from .config.tensor_parallel import check_model as check_tensor_parallel_model
from .passes import default_passes
from .passes.offload_embeddings import check_offload_layers
from .pipeline import PassContext, PassManager, Probe, Program
from .optimized_model import OptimizedModel
from .runtime.build import ModelIdentity, build_engine
from .runtime.distributed import BroadcastRunner, RankGroup, agree_on_blocks, init_rank_group, rank_info
from .runtime.kv_prune import active_config as active_kv_prune
from .runtime.kv_tiers_tp import rank_tiers_for
from .runtime.scratch import scratch_step, scratch_steps
from .runtime.speculative.factory import DraftBuilder
from .weights import own_weights

log = logging.getLogger(__name__)


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
    group, config = _rank_group(model, info, config)  # tensor_parallel > 1: checked before any weight moves
    offload_roles = set(check_offload_layers(model, list(config.offload_layers)).values())
    callers = model
    if config.dtype is not None and next(model.parameters()).dtype != config.dtype:
        model = copy.deepcopy(model).to(config.dtype)
    if config.device is not None and next(model.parameters()).device != torch.device(config.device):
        model = model.to(config.device)
    quant = _resolve_quantization(model, tokenizer, config)
    t_capture = time.perf_counter()
    log.info("capturing %s with torch.export", type(model).__name__)
    gm, info = capture(model, info=info, stack_traces=config.dump_dir is not None)
    log.info("captured %s in %.1f s", type(model).__name__, time.perf_counter() - t_capture)
    if info.max_step_tokens is not None:  # the graph holds only up to this many tokens a step
        config = config.limited_to_step_tokens(info.max_step_tokens)
    if config.scheduler.max_model_len is not None:
        info.max_model_len = config.scheduler.max_model_len
    program = Program({"main": gm})
    ctx = PassContext(info=info, config=config, scratch_step=scratch_steps(info))
    probe = make_probe(info, info.device) if config.verify else None
    passes = default_passes(config, offload_roles, quant, group.spec if group is not None else None)
    report = PassManager(passes, dump_dir=config.dump_dir, probe=probe).run(program, ctx)
    if model is callers and group is None:  # (a converted copy dies with this call: the program keeps what it reads)
        own_weights(program, model)
    drafts = DraftBuilder(model, tokenizer, vocab_size=info.vocab_size, dtype=info.dtype, compile=optimize)
    # tensor_parallel > 1: rank 0 alone proposes (a draft model runs whole there, tensor_parallel=1)
    speculates = config.speculative is not None and (group is None or group.rank == 0)
    proposer = drafts(config.speculative) if speculates else None
    identity = (ModelIdentity.of(model, None if quant is None else [quant[0].fingerprint, repr(quant[1])])
                if config.kv_cache_tiers else None)
    tiers_for = None
    if group is not None:  # this rank's heads; a KV pool of the same number of blocks on every rank
        tiers_for = rank_tiers_for(group, info)  # KV tiers of whole blocks, on rank 0
        info = rank_info(info, group.spec)
        config = agree_on_blocks(group, info, config)
    t_build = time.perf_counter()
    engine = build_engine(program, info, config, tokenizer=tokenizer, proposer=proposer, identity=identity,
                          kv_tiers_for=tiers_for)
    log.info("engine built in %.1f s (KV pool%s); optimize() took %.1f s", time.perf_counter() - t_build,
             ", kernel warm-up" if config.warmup else "", time.perf_counter() - t0)
    if group is not None and group.rank == 0:
        engine.runner = BroadcastRunner(engine.runner, group)
    return OptimizedModel(engine, info, config, report, tokenizer, time.perf_counter() - t0, rank_group=group,
                          hf_config=getattr(model, "config", None), drafts=drafts,
                          quant_result=_kept(quant, config),
                          precision_table=ctx.outputs.precision_table, quant_note=ctx.outputs.precision_note)


def _rank_group(model: torch.nn.Module, info: ModelInfo,
                config: OptimizeConfig) -> tuple[RankGroup | None, OptimizeConfig]:
    """With ``tensor_parallel`` > 1: check the model splits over the ranks and the world has that many, then
    join (or initialise, from torchrun's env://) the process group; on CUDA each rank takes the device of its
    ``LOCAL_RANK``. None (and ``config`` unchanged) otherwise."""
    tp = config.tensor_parallel
    if tp == 1:
        return None, config
    check_tensor_parallel_model(info.num_heads, info.num_kv_heads, tp, mla=info.mla is not None,
                                hf_config=getattr(model, "config", None))
    device = torch.device(config.device) if config.device is not None else info.device
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        config = dataclasses.replace(config, device=str(device))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return init_rank_group(tp, device), config


def _kept(quant, config: OptimizeConfig):
    """What ``OptimizedModel.quant_result`` holds: the QuantResult, without its tensors unless asked."""
    if quant is None:
        return None
    return quant[0] if config.keep_quant_result else quant[0].without_tensors()


def _resolve_quantization(model: torch.nn.Module, tokenizer, config: OptimizeConfig):
    """(QuantResult, QuantConfig) for the assign_precision pass, or None: quantize now
    (``quantization={...}``) or load a saved artifact (``quantized="dir/"``)."""
    from .quant import QuantConfig, artifact, quantize_for_optimize
    from .quant.config import MACHINE_KEYS
    from .quant.result import check_tiers

    if config.quantized is not None:
        result = artifact.load(config.quantized, model)
        merged = {k: v for k, v in result.config.items()
                  if k in QuantConfig.__dataclass_fields__ and k not in MACHINE_KEYS}
        merged.update(config.quantization or {})
        qcfg = QuantConfig.coerce(merged)
        check_tiers(result, qcfg.tiers, f"the artifact {config.quantized}")
        return result, qcfg
    if config.quantization is not None:
        return quantize_for_optimize(model, tokenizer, config.quantization), config.quantization
    return None
