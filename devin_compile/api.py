"""optimize(): capture → PassManager → runtime.Engine → OptimizedModel."""
from __future__ import annotations

import copy
import time
from typing import Any, Sequence as Seq

import torch
from transformers.modeling_outputs import CausalLMOutput

from .backends.attention.registry import get_backend, select_attention_backend
from .capture import ModelInfo, capture, model_info
from .config import OptimizeConfig
from .passes import default_passes
from .passes.offload_embeddings import check_offload_layers
from .pipeline import PassContext, PassManager, PassReport, Probe, Program
from .runtime.engine import Engine, RequestError, RequestOutput
from .runtime.kv_cache import KVCacheSpec, PagedKVCache, blocks_for_budget
from .runtime.kv_prune import active_config as active_kv_prune
from .runtime.model_runner import ModelRunner
from .runtime.sampling import SamplingParams
from .runtime.scratch import scratch_step, scratch_steps


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


class OptimizedModel:
    """What ``optimize()`` returns: HF-like ``generate``/``__call__`` over the compiled engine."""

    def __init__(self, engine: Engine, info: ModelInfo, config: OptimizeConfig, report: PassReport,
                 tokenizer=None, compile_seconds: float = 0.0, hf_config=None) -> None:
        self.engine = engine
        self.info = info
        self.optimize_config = config
        self.pass_report = report
        self.tokenizer = tokenizer
        self.compile_seconds = compile_seconds
        self.config = hf_config
        self.quant_result = None  # the QuantResult compiled in (INT4 models)
        self.precision_table: list[dict] = []  # assign_precision's per-layer rows (INT4 models)
        self.quant_note = ""

    @property
    def program(self) -> Program:
        return self.engine.runner.program

    def async_engine(self) -> "AsyncEngine":
        """An asyncio front over this model's engine, for callers that submit concurrently
        (don't drive ``generate`` on the same model while it runs)."""
        from .runtime.async_engine import AsyncEngine

        return AsyncEngine(self.engine)

    def wait_until_ready(self) -> None:
        """Block until kernels that the attention backend started compiling in the background
        are done (a backend with a ``wait_until_ready`` method; none of today's CPU backends
        compiles in the background, so this returns at once there). Generation never needs
        it; benchmarks call it so a compile does not share the CPU with what they time."""
        wait = getattr(self.engine.runner.backend, "wait_until_ready", None)
        if wait is not None:
            wait()

    def report(self) -> str:
        """One row per pass: status, time, matches, nodes before/after (markdown)."""
        return self.pass_report.as_markdown()

    # -- generation -------------------------------------------------------
    def generate(self, prompts: Seq[Any] | str | None = None, max_new_tokens: int | Seq[int] = 16, *,
                 input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                 do_sample: bool = False, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int | None = None, ignore_eos: bool = False, stop_token_ids: Seq[int] = (),
                 logits_processors: Seq[Any] = (), params: SamplingParams | Seq[SamplingParams] | None = None):
        """Generate for a batch. Three forms:

        - ``generate([[ids...], ...])`` → list of new-token lists;
        - ``generate(["text", ...])`` (needs a tokenizer) → list of new texts;
        - ``generate(input_ids=tensor, attention_mask=...)`` → tensor [B, T + new] like HF
          (prompt then new tokens, right-padded with the pad id).
        """
        tensor_mode = input_ids is not None
        if tensor_mode:
            if prompts is not None:
                raise ValueError("pass either prompts or input_ids=, not both")
            prompts = _rows_from_tensor(input_ids, attention_mask)
        if prompts is None:
            raise ValueError("generate() needs prompts (token lists or strings) or input_ids=")
        single_text = isinstance(prompts, str)
        if single_text:
            prompts = [prompts]
        prompts = list(prompts)
        text_mode = bool(prompts) and all(isinstance(p, str) for p in prompts)
        n = len(prompts)
        if params is None:
            lengths = [max_new_tokens] * n if isinstance(max_new_tokens, int) else list(max_new_tokens)
            if len(lengths) != n:
                raise ValueError(f"max_new_tokens has {len(lengths)} entries for {n} prompts")
            params = [SamplingParams(max_new_tokens=m, do_sample=do_sample, temperature=temperature, top_k=top_k,
                                     top_p=top_p, seed=None if seed is None else seed + i, ignore_eos=ignore_eos,
                                     stop_token_ids=list(stop_token_ids), logits_processors=list(logits_processors))
                      for i, m in enumerate(lengths)]
        elif isinstance(params, SamplingParams):
            params = [params] * n
        results = self._run_batch(prompts, list(params))
        outs = [r.output_ids for r in results]
        if tensor_mode:
            return _to_tensor(input_ids, outs, self._pad_id())
        if text_mode:
            texts = [self.tokenizer.decode(o, skip_special_tokens=True) for o in outs]
            return texts[0] if single_text else texts
        return outs

    def _run_batch(self, prompts: list, params: list[SamplingParams]) -> list[RequestOutput]:
        engine = self.engine
        added: list[str] = []
        try:
            for i, (p, sp) in enumerate(zip(prompts, params)):
                added.append(engine.add_request(p, sp))
        except ValueError as e:
            for rid in added:
                engine.abort(rid)
            raise ValueError(f"prompt {len(added)}: {e}") from None
        while any(not engine.requests[r].status.done for r in added):
            if not engine.step():
                engine.wait_for_admission()
        results = [engine._output(engine.requests[r], []) for r in added]
        failed = [r for r in results if r.error]
        if failed:
            err = RequestError(failed[0].request_id, "; ".join(f"{r.request_id}: {r.error}" for r in failed))
            err.results = results
            raise err
        return results

    def _pad_id(self) -> int:
        cfg = self.config
        pad = getattr(cfg, "pad_token_id", None) if cfg is not None else None
        if pad is None and self.info.eos_token_ids:
            pad = self.info.eos_token_ids[0]
        return int(pad or 0)

    # -- full-sequence forward -----------------------------------------------
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **_: Any) -> CausalLMOutput:
        """Logits for every position, like ``model(input_ids).logits`` (padding positions are 0)."""
        rows = _rows_from_tensor(input_ids, attention_mask)
        B, T = input_ids.shape
        runner = self.engine.runner
        alloc = self.engine.allocator
        bs = runner.block_size
        logits = None
        for b, row in enumerate(rows):
            nblocks = (len(row) + bs - 1) // bs
            blocks = alloc.allocate(nblocks)
            try:
                out = runner.run(row, list(range(len(row))), [blocks[p // bs] * bs + p % bs for p in range(len(row))],
                                 [len(row)], [len(row)], [blocks], list(range(len(row))))
            finally:
                alloc.free(blocks)
            if logits is None:
                logits = torch.zeros((B, T, out.shape[-1]), dtype=out.dtype)
            cols = _real_columns(attention_mask, b, T)
            logits[b, cols] = out.to("cpu")
        return CausalLMOutput(logits=logits)

    forward = __call__


def _real_columns(mask: torch.Tensor | None, b: int, T: int) -> torch.Tensor:
    if mask is None:
        return torch.arange(T)
    return mask[b].nonzero().flatten().cpu()


def _rows_from_tensor(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[list[int]]:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() not in (1, 2):
        raise ValueError("input_ids must be a [B, T] (or [T]) integer tensor")
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape {tuple(input_ids.shape)}")
    rows = []
    for b in range(input_ids.shape[0]):
        row = input_ids[b]
        if attention_mask is not None:
            row = row[attention_mask[b].bool()]
        rows.append(row.tolist())
    return rows


def _to_tensor(input_ids: torch.Tensor, outs: list[list[int]], pad: int) -> torch.Tensor:
    ids = input_ids if input_ids.dim() == 2 else input_ids[None]
    width = max(len(o) for o in outs)
    new = torch.full((len(outs), width), pad, dtype=ids.dtype)
    for i, o in enumerate(outs):
        new[i, : len(o)] = torch.tensor(o, dtype=ids.dtype)
    return torch.cat([ids.cpu(), new], dim=1)


def optimize(model: torch.nn.Module, tokenizer=None, **options: Any) -> OptimizedModel:
    """Compile an HF causal LM into a paged-KV engine. Options: see :class:`OptimizeConfig`."""
    if "kv_prune" not in options and active_kv_prune() is not None:  # inside enable_kv_pruning
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
    report = PassManager(default_passes(config, info, offload_roles, quant), dump_dir=config.dump_dir,
                         probe=probe).run(program, ctx)
    spec = KVCacheSpec(info.num_layers, info.num_kv_heads, info.head_dim, info.dtype, config.cache.block_size)
    nblocks = blocks_for_budget(spec, info.device, num_blocks=config.cache.num_blocks,
                                memory_bytes=config.cache.memory_bytes, memory_fraction=config.cache.memory_fraction)
    cache = PagedKVCache(spec, nblocks, info.device)
    backend = select_attention_backend(info.device, config.attention_backend)
    if config.warmup and hasattr(backend, "warm_up"):
        backend.warm_up(dtype=info.dtype, num_kv_heads=info.num_kv_heads, num_heads=info.num_heads,
                        head_dim=info.head_dim)
    runner = ModelRunner(program, cache, vocab_size=info.vocab_size, backend=backend, device=info.device)
    engine = Engine(runner, config.scheduler, max_model_len=info.max_model_len, eos_token_ids=info.eos_token_ids,
                    tokenizer=tokenizer, enable_prefix_caching=config.cache.enable_prefix_caching,
                    kv_prune=config.kv_prune)
    opt = OptimizedModel(engine, info, config, report, tokenizer, time.perf_counter() - t0,
                         hf_config=getattr(model, "config", None))
    opt.quant_result = quant[0] if quant is not None else None
    opt.precision_table = ctx.extras.get("precision_table", [])
    opt.quant_note = next((r.note for r in report.records if r.name == "assign_precision"), "")
    return opt


def _resolve_quantization(model: torch.nn.Module, tokenizer, config: OptimizeConfig):
    """(QuantResult, QuantConfig) for the assign_precision pass, or None: quantize now
    (``quantization={...}``) or load a saved artifact (``quantized="dir/"``)."""
    from .quant import QuantConfig, artifact, quantize_for_optimize

    if config.quantized is not None:
        result = artifact.load(config.quantized, model)
        merged = {k: v for k, v in result.config.items() if k in {f for f in QuantConfig.__dataclass_fields__}}
        merged.update(config.quantization or {})
        return result, QuantConfig.coerce(merged)
    if config.quantization is not None:
        return quantize_for_optimize(model, tokenizer, config.quantization), config.quantization
    return None
