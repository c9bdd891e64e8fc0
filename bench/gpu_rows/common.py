"""What every GPU check row shares: the row recorder with its time budget, model builders (seeded
random weights from transformers configs: nothing is downloaded), a byte-level tokenizer for
calibration, and device timing helpers."""
from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass, field

import torch

_COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0,
               tie_word_embeddings=False, initializer_range=0.1)
# Four tiny families and what each exercises on the GPU backends.
FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),  # qkv bias
    "mistral": ("MistralConfig", dict(sliding_window=12)),  # sliding window
    "gemma2": ("Gemma2Config", dict(head_dim=16, sliding_window=7, attn_logit_softcapping=1.0,
                                    final_logit_softcapping=5.0, query_pre_attn_scalar=16)),  # soft-cap + window
}
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
               tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=8192,
                rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)


@dataclass
class Run:
    """The device, the smoke flag (tiny shapes, for checking the script on a CPU) and the rows so far."""

    device: torch.device
    smoke: bool
    deadline: float
    rows: list[dict] = field(default_factory=list)

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def check(name: str, need_s: float = 0.0, cuda_only: bool = False, triton: bool = False):
    """A row: the function's return value is its detail; ("skip", why) skips; an exception is a FAIL
    row (the run goes on); a row that would start with less than ``need_s`` seconds left is skipped.
    ``triton``: runs Triton kernels, so on a CPU only under ``TRITON_INTERPRET=1``."""
    def deco(fn):
        def run(r: Run):
            t0 = time.perf_counter()
            try:
                if cuda_only and r.device.type != "cuda":
                    res = ("skip", "needs CUDA")
                elif triton and r.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
                    res = ("skip", "Triton kernels on a CPU need TRITON_INTERPRET=1")
                elif r.left() < need_s:
                    res = ("skip", f"time budget: {r.left():.0f} s left, the row needs ~{need_s:.0f} s")
                else:
                    res = fn(r)
                status, detail = ("skipped", res[1]) if isinstance(res, tuple) and res[0] == "skip" else ("ok", res)
            except Exception as e:  # noqa: BLE001  (a failing check is a row, not the end of the run)
                status, detail = "FAIL", f"{type(e).__name__}: {e}"
                traceback.print_exc()
            r.rows.append({"check": name, "status": status, "seconds": round(time.perf_counter() - t0, 1),
                           "detail": detail})
            print(f"[{status}] {name} ({time.perf_counter() - t0:.0f} s): {detail}", flush=True)
            if r.device.type == "cuda":
                torch.cuda.empty_cache()
        run.__name__ = fn.__name__
        return run
    return deco


def build(config_cls: str, kw: dict, dtype: torch.dtype, device: torch.device, seed: int = 0,
          attn: str = "sdpa"):
    """A causal LM from a transformers config class with seeded random weights, made on ``device``."""
    import transformers
    from transformers import AutoModelForCausalLM

    cfg = getattr(transformers, config_cls)(**kw)
    cfg._attn_implementation = attn
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, torch_dtype=dtype)
    return model.eval()


def family(name: str, dtype: torch.dtype, device: torch.device):
    cls, extra = FAMILIES[name]
    return build(cls, {**_COMMON, **extra}, dtype, device, attn="eager" if name == "gemma2" else "sdpa")


def smollm2_shaped(dtype, device, smoke: bool):
    kw = dict(SMOLLM2, num_hidden_layers=2, vocab_size=2048) if smoke else SMOLLM2
    return build("LlamaConfig", kw, dtype, device)


def llama_1b_shaped(dtype, device, smoke: bool):
    kw = dict(LLAMA_1B, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=2, head_dim=32, vocab_size=4096) if smoke else LLAMA_1B
    return build("LlamaConfig", kw, dtype, device, seed=3)


def prompt(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def byte_tokenizer():
    """A byte-level BPE tokenizer with no merges (ids 0..255), built offline: calibration text for
    quantizing a model whose own tokenizer is not at hand."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def copy_bandwidth(device: torch.device, mib: int = 1024, repeats: int = 10) -> float:
    """Device memory bandwidth, bytes/s: a device-to-device copy (read + write) of ``mib`` MiB, best of ``repeats``."""
    src = torch.empty(mib << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() / best


def weight_bytes(model) -> int:
    """Bytes a decode step reads of the weights: every parameter but the input embedding (a tied
    head reads it once as the lm_head)."""
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return total - (0 if head is emb else emb.numel() * emb.element_size())
