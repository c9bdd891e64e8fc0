"""OptimizedModel: what ``optimize()`` returns; HF-like ``generate`` / ``__call__`` over the engine.

It only translates: HF-style arguments (token lists, strings, ``input_ids`` tensors with an
``attention_mask``) into prompts and :class:`~devin_compile.runtime.sampling.SamplingParams`,
and the engine's results back. Every run goes through public
:class:`~devin_compile.runtime.engine.Engine` methods: ``generate`` (a batch to completion)
and ``forward_logits`` (a full-sequence forward).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator, Sequence as Seq

import torch
from transformers.modeling_outputs import CausalLMOutput

from .capture import ModelInfo
from .config import OptimizeConfig
from .pipeline import PassReport, Program
from .runtime.distributed import RankGroup, on_all_ranks
from .runtime.engine import Engine
from .runtime.sampling import SamplingParams
from .text.detokenizer import TextStream
from .text.chat_template import chat_prompt_ids

if TYPE_CHECKING:
    from .runtime.async_engine import AsyncEngine


class OptimizedModel:
    """What ``optimize()`` returns: HF-like ``generate``/``__call__`` over the compiled engine."""

    def __init__(self, engine: Engine, info: ModelInfo, config: OptimizeConfig, report: PassReport,
                 tokenizer=None, compile_seconds: float = 0.0, hf_config=None, *, drafts=None,
                 quant_result=None, precision_table: Seq[dict] = (), quant_note: str = "",
                 rank_group: RankGroup | None = None) -> None:
        self.engine = engine
        # tensor_parallel > 1: generate and __call__ run on rank 0 while the other ranks follow its forwards,
        # and every rank returns rank 0's result (runtime/distributed.py)
        self.rank_group = rank_group
        self.info = info
        self.optimize_config = config
        self.pass_report = report
        self.tokenizer = tokenizer
        self.compile_seconds = compile_seconds
        self.config = hf_config
        self.quant_result = quant_result  # the QuantResult compiled in (INT4 models)
        self.precision_table: list[dict] = list(precision_table)  # assign_precision's per-layer rows
        self.quant_note = quant_note
        self._drafts = drafts  # (SpeculativeConfig, target) → proposer for this target; None: no set_draft

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

    def set_draft(self, speculative: Any, target: torch.nn.Module | None = None) -> None:
        """Hot swap speculative decoding: ``{"method": "draft", "model": other}`` (any form
        ``optimize(speculative=...)`` takes; None/False: off). Requests admitted from now on use it;
        requests in flight finish on the proposer they started with. The new draft is compiled
        before anything changes, so a bad one (``ValueError``) leaves the old one in place.
        ``target``: the model this was optimized from, for the ``head`` and ``self-int4`` methods
        when the caller no longer holds the original object (the optimized model does not keep it)."""
        from .config import SpeculativeConfig

        config = SpeculativeConfig.coerce(speculative, "set_draft")
        if config is not None and self._drafts is None:
            raise ValueError("set_draft needs an OptimizedModel built by optimize()")
        proposer = self._drafts(config, target) if config is not None else None
        self.engine.set_proposer(proposer, config)

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

        Errors: an empty batch (``generate([])``, ``input_ids`` with no rows) is a
        ``ValueError``, as in Hugging Face's ``generate``, rather than an empty result; so is
        an empty prompt in a batch (``prompt i: empty prompt ...``), and any invalid prompt
        rejects the whole batch. A request that fails mid-way (e.g. a logits processor
        raised) raises :class:`~devin_compile.runtime.engine.RequestError` once the batch
        is done, with every request's output in ``.results``.
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
        if not prompts:
            raise ValueError("generate() got an empty batch (no prompts): pass at least one prompt, e.g. "
                             "generate([[token ids]]) or generate(['text'])")
        text_mode = all(isinstance(p, str) for p in prompts)
        n = len(prompts)
        if params is None:
            lengths = [max_new_tokens] * n if isinstance(max_new_tokens, int) else list(max_new_tokens)
            if len(lengths) != n:
                raise ValueError(f"max_new_tokens has {len(lengths)} entries for {n} prompts")
            params = [SamplingParams(max_new_tokens=m, do_sample=do_sample, temperature=temperature, top_k=top_k,
                                     top_p=top_p, seed=None if seed is None else seed + i, ignore_eos=ignore_eos,
                                     stop_token_ids=list(stop_token_ids), logits_processors=list(logits_processors))
                      for i, m in enumerate(lengths)]
        elif not isinstance(params, SamplingParams):
            params = list(params)
        results = on_all_ranks(self.rank_group, self.engine.runner,
                               lambda: self.engine.generate(prompts, params, raise_on_error=True))
        outs = [r.output_ids for r in results]
        if tensor_mode:
            return _to_tensor(input_ids, outs, self._pad_id())
        if text_mode:
            texts = [self.tokenizer.decode(o, skip_special_tokens=True) for o in outs]
            return texts[0] if single_text else texts
        return outs

    # -- text: chat template, streaming ------------------------------------------
    def chat_ids(self, messages: Seq[dict]) -> list[int]:
        """Prompt token ids of OpenAI-style ``messages`` under the tokenizer's chat template."""
        return chat_prompt_ids(self.tokenizer, messages)

    def chat(self, messages: Seq[dict], max_new_tokens: int = 64, *, stop: Seq[str] = (), **sampling: Any) -> str:
        """The assistant's reply to ``messages`` (the tokenizer's chat template applied), as text.
        ``sampling``: ``SamplingParams`` fields (``do_sample``, ``temperature``, ``seed``, ...)."""
        return "".join(self.stream_text(self.chat_ids(messages), max_new_tokens, stop=stop, **sampling))

    def stream_text(self, prompt: str | Seq[int], max_new_tokens: int = 64, *, stop: Seq[str] = (),
                    **sampling: Any) -> Iterator[str]:
        """Yield the new text as it is generated (incremental detokenisation: never half a UTF-8
        character; generation ends at the first of ``stop``, which is not yielded)."""
        if self.tokenizer is None:
            raise ValueError("stream_text needs a tokenizer: pass tokenizer= to optimize()")
        if isinstance(stop, str):
            stop = [stop]
        params = SamplingParams(max_new_tokens=max_new_tokens, **sampling)
        rid = self.engine.add_request(prompt, params)
        text = TextStream(self.tokenizer, self.engine.requests[rid].prompt_ids, stop)
        try:
            for tok in self.engine.stream(rid):
                delta = text.add([tok])
                if delta:
                    yield delta
                if text.stopped:
                    return
            delta = text.finish()
            if delta:
                yield delta
        finally:
            self.engine.abort(rid)  # a stop string, or the caller stopped iterating: free the KV blocks

    def _pad_id(self) -> int:
        cfg = self.config
        pad = getattr(cfg, "pad_token_id", None) if cfg is not None else None
        if pad is None and self.info.eos_token_ids:
            pad = self.info.eos_token_ids[0]
        return int(pad or 0)

    # -- full-sequence forward -----------------------------------------------
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **_: Any) -> CausalLMOutput:
        """Logits for every position, like ``model(input_ids).logits`` (padding positions are 0).

        ``ValueError`` for an empty input (no rows, no positions, or a row whose
        ``attention_mask`` is all zeros): there is no position to compute logits for.
        """
        rows = _rows_from_tensor(input_ids, attention_mask)
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        B, T = input_ids.shape
        if B == 0:
            raise ValueError(f"input_ids has shape {tuple(input_ids.shape)}: an empty batch has no sequence to "
                             "compute logits for; pass at least one row, e.g. a [1, T] tensor with T >= 1")
        if T == 0:
            raise ValueError(f"input_ids has shape {tuple(input_ids.shape)}: an empty sequence has no positions to "
                             "compute logits for; pass at least one token per row, e.g. a [1, T] tensor with T >= 1")
        logits = None
        for b, row in enumerate(rows):
            if not row:
                raise ValueError(f"row {b} of input_ids has no tokens under attention_mask (all zeros): an empty "
                                 "sequence has no logits; give every row at least one unmasked token")
            out = on_all_ranks(self.rank_group, self.engine.runner, lambda: self.engine.forward_logits(row))
            if logits is None:
                logits = torch.zeros((B, T, out.shape[-1]), dtype=out.dtype)
            logits[b, _real_columns(attention_mask, b, T)] = out.to("cpu")
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
