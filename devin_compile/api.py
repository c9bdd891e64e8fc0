"""optimize(): capture → PassManager → runtime.build_engine → OptimizedModel (assembly only)."""
from __future__ import annotations

import copy
import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from .backends.attention.registry import get_backend
from .capture import ModelInfo, capture, model_info
from .compile_cache import (Compiled, cached_compile, folder_digest, key_parts, off_by_env, options_json,
                            use_inductor_cache)
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
    # Fail fast on unsupported models, before any copy; the mask probe (one forward) waits for a miss
    # when the compile cache may hold the program (whose ModelInfo has the masks' facts).
    info = model_info(model, probe_masks=_cache_root(config, None)[1] is not None)
    if info.has_recurrent_state:
        _check_recurrent_options(config)
    group, config = _rank_group(model, info, config)  # tensor_parallel > 1: checked before any weight moves
    offload_roles = set(check_offload_layers(model, list(config.offload_layers)).values())
    _check_offload_head(config, offload_roles, info)
    callers = model
    if config.dtype is not None and next(model.parameters()).dtype != config.dtype:
        model = copy.deepcopy(model).to(config.dtype)
    if config.device is not None and next(model.parameters()).device != torch.device(config.device):
        model = model.to(config.device)
    compiled, config = _compile(model, tokenizer, info, config, offload_roles, group)
    program, info = compiled.program, compiled.info
    if model is callers and group is None:  # (a converted copy dies with this call: the program keeps what it reads)
        own_weights(program, model)
    drafts = DraftBuilder(model, tokenizer, vocab_size=info.vocab_size, dtype=info.dtype, compile=optimize)
    # tensor_parallel > 1: rank 0 alone proposes (a draft model runs whole there, tensor_parallel=1)
    speculates = config.speculative is not None and (group is None or group.rank == 0)
    proposer = drafts(config.speculative) if speculates else None
    identity = ModelIdentity.of(model, compiled.quant_identity) if config.kv_cache_tiers else None
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
    return OptimizedModel(engine, info, config, compiled.report, tokenizer, time.perf_counter() - t0,
                          rank_group=group, hf_config=getattr(model, "config", None), drafts=drafts,
                          quant_result=compiled.quant_result, precision_table=compiled.outputs.precision_table,
                          quant_note=compiled.outputs.precision_note)


def _compile(model: torch.nn.Module, tokenizer, info: ModelInfo, config: OptimizeConfig, offload_roles: set,
             group: RankGroup | None) -> tuple[Compiled, OptimizeConfig]:
    """Capture and passes, or their result read from the compile cache; ``config`` as the program bounds it."""
    t0 = time.perf_counter()
    root, why_not = _cache_root(config, group)
    spec = group.spec if group is not None else None
    # passes whose output the cache cannot hold (compile_decode's callables) run after it, on what it returns
    late = [] if why_not is not None else [p for p in default_passes(config, offload_roles, None, spec) if not p.cached]

    def build() -> Compiled:
        return _capture_and_compile(model, tokenizer, info, config, offload_roles, group, {p.name for p in late})

    if why_not is not None:
        compiled, status = build(), why_not
    else:
        device = next(model.parameters()).device
        artifact = {"quantized_artifact": folder_digest(config.quantized)} if config.quantized is not None else {}
        parts = key_parts(model, device, options_json(config, artifact))
        if late:  # their Inductor code is kept in torch's caches, under this cache's root
            use_inductor_cache(root)
        compiled, status = cached_compile(model, parts, build, root=root)
    log.info("compiled %s in %.1f s (compile cache: %s)", type(model).__name__, time.perf_counter() - t0, status)
    config = _bounded(config, compiled.info)
    if late:
        ctx = PassContext(info=compiled.info, config=config, scratch_step=scratch_steps(compiled.info))
        ran = [r.name for r in compiled.report.records]
        compiled.report.records += PassManager(late, ran_before=ran).run(compiled.program, ctx).records
    return compiled, config


def _cache_root(config: OptimizeConfig, group: RankGroup | None) -> tuple[Path | None, str | None]:
    """``(root, None)`` when the compile cache is used (root None: the default one), else ``(None, why not)``."""
    if config.compile_cache is False or (config.compile_cache is True and off_by_env()):
        return None, "off"
    for on, why in ((group is not None or config.tensor_parallel > 1, "tensor parallel"),
                    (config.dump_dir is not None, "dumping passes"), (config.keep_quant_result, "keep_quant_result")):
        if on:
            return None, f"not used with {why}"
    return (None if config.compile_cache is True else Path(config.compile_cache)), None


def _bounded(config: OptimizeConfig, info: ModelInfo) -> OptimizeConfig:
    """``config`` as the captured program bounds it: steps of at most ``max_step_tokens`` tokens."""
    if info.max_step_tokens is not None:  # the graph holds only up to this many tokens a step
        config = config.limited_to_step_tokens(info.max_step_tokens)
    return config


def _capture_and_compile(model: torch.nn.Module, tokenizer, info: ModelInfo, config: OptimizeConfig,
                         offload_roles: set, group: RankGroup | None, leave_out: set[str]) -> Compiled:
    """Quantization (when asked), capture and the pass pipeline but the passes named in ``leave_out``:
    the compiled program."""
    if not info.masks_probed:  # (see optimize())
        info = model_info(model)
    quant = _resolve_quantization(model, tokenizer, config)
    t_capture = time.perf_counter()
    log.info("capturing %s with torch.export", type(model).__name__)
    gm, info = capture(model, info=info, stack_traces=config.dump_dir is not None)
    log.info("captured %s in %.1f s", type(model).__name__, time.perf_counter() - t_capture)
    config = _bounded(config, info)
    if config.scheduler.max_model_len is not None:
        info.max_model_len = config.scheduler.max_model_len
    program = Program({"main": gm})
    ctx = PassContext(info=info, config=config, scratch_step=scratch_steps(info))
    probe = make_probe(info, info.device) if config.verify else None
    passes = [p for p in default_passes(config, offload_roles, quant, group.spec if group is not None else None)
              if p.name not in leave_out]
    report = PassManager(passes, dump_dir=config.dump_dir, probe=probe).run(program, ctx)
    return Compiled(program, info, report, ctx.outputs, quant_result=_kept(quant, config),
                    quant_identity=None if quant is None else [quant[0].fingerprint, repr(quant[1])])


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


def _check_recurrent_options(config: OptimizeConfig) -> None:
    """Options a model with recurrent layers (Mamba, gated DeltaNet, RG-LRU: a state pool beside the KV cache)
    cannot take, each refused by name before any work (prefix caching, on by default, is turned off by
    ``build_engine``)."""
    spec = config.speculative
    from_target = spec is not None and (spec.method == "head" or isinstance(spec.model, str))  # head, self-int4
    refused = [(from_target, "speculative= with a draft made from the target", "that draft has the target's "
                "recurrent layers, whose own state a draft proposer does not roll back (use method='ngram' or a "
                "draft model without recurrent layers)"),
               (config.kv_prune is not None, "kv_prune=", "pruning K/V does not prune a recurrent state"),
               (bool(config.kv_cache_tiers), "kv_cache_tiers=", "KV blocks do not hold the recurrent state"),
               (config.compile_decode, "compile_decode=True", "the ahead-compiled decode steps carry no state slots"),
               (config.tensor_parallel > 1, "tensor_parallel > 1", "the mixers are not split over ranks")]
    for on, what, why in refused:
        if on:
            raise ValueError(f"{what} is not supported for models with recurrent layers (Mamba, gated DeltaNet, "
                             f"RG-LRU): {why}; drop {what.split('=')[0].split(' ')[0]}")


def _check_offload_head(config: OptimizeConfig, offload_roles: set, info: ModelInfo) -> None:
    """``offload_layers=["lm_head"]`` off the CPU with ``quantization=`` quantizing the head: refused before
    quantizing (offload_embeddings moves only a head in the model dtype)."""
    from .quant import QuantConfig

    device = torch.device(config.device) if config.device is not None else info.device
    head = getattr(QuantConfig.coerce(config.quantization), "lm_head", False)
    if "lm_head" in offload_roles and device.type != "cpu" and head:
        raise ValueError(f"offload_layers=['lm_head'] with quantization lm_head={head!r}: a quantized head is not "
                         "moved to the CPU yet; pass quantization={..., 'lm_head': False} to keep the head in the "
                         "model dtype, or drop lm_head from offload_layers")


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
