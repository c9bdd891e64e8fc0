"""What an entry of the compile cache is keyed by: the weights, the model's config and code, the
options, the versions, and the machine's instruction set.

A key is the SHA-256 of :class:`KeyParts` as sorted JSON. The parts are kept beside the entry
(``key.json``) so that ``devin-compile cache ls`` can say what an entry is for, and a test can
change one part (another torch version) and see a miss. An entry holds weights the passes derived
(packed, fused, quantized), so the weights part reads every byte of every parameter and buffer
(xxh3, ~0.1 s for SmolLM2's 513 MB): a model edited in one element is another key.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import json
import platform
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
import xxhash

from ..backends.native.kernel_cache import cpu_flags

#: Bumped when what an entry holds, or how it is read, changes.
FORMAT = "2"

_PACKAGE = Path(__file__).resolve().parents[1]
_SOURCE_SUFFIXES = {".py", ".c", ".cpp", ".h", ".json", ".jsonl", ".txt", ".md"}


@dataclass(frozen=True)
class KeyParts:
    """Everything an entry depends on (see the module docstring)."""

    weights: str  # xxh3 of every parameter and buffer (names, dtypes, shapes, bytes)
    model_config: str  # the HF config, as sorted JSON
    model_code: str  # a digest of the source file of the model's class
    options: str  # the optimize() options that shape the program, as sorted JSON
    versions: str  # devin-compile (with a digest of its sources), torch, transformers
    isa: str  # the CPU's feature flags, or the GPU's compute capability
    format: str = FORMAT

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:32]


def weights_digest(model: torch.nn.Module) -> str:
    """xxh3-128 over every parameter and buffer of ``model``: name, dtype, shape and bytes."""
    h = xxhash.xxh3_128()
    for name, t in sorted(model.state_dict(keep_vars=True).items()):
        h.update(json.dumps([name, str(t.dtype), list(t.shape)]).encode())
        flat = t.detach().to("cpu").contiguous().reshape(-1)
        if flat.numel():
            h.update(flat.view(torch.uint8).numpy())
    return h.hexdigest()


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "unknown"


@functools.cache
def _sources_digest() -> str:
    """A digest of devin-compile's own sources (Python, C, data): a checkout's edit is a new key."""
    h = xxhash.xxh3_64()
    for path in sorted(_PACKAGE.rglob("*")):
        if path.suffix in _SOURCE_SUFFIXES and "__pycache__" not in path.parts:
            h.update(str(path.relative_to(_PACKAGE)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def versions() -> dict[str, str]:
    """The versions an entry is valid for (torch's own, as imported; devin-compile's with its sources)."""
    return {"devin-compile": f"{_version('devin-compile')}+src.{_sources_digest()}",
            "torch": torch.__version__, "transformers": _version("transformers")}


def isa(device: torch.device) -> str:
    """The instruction set compiled code is specific to: compute capability on CUDA, CPU flags else."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"cuda sm_{major}{minor} {torch.cuda.get_device_name(device)}"
    flags = hashlib.sha256(cpu_flags().encode()).hexdigest()[:16]
    return f"{device.type} {platform.machine()} flags:{flags}"


def _model_code(model: torch.nn.Module) -> str:
    try:
        source = Path(inspect.getsourcefile(type(model)) or "").read_bytes()
    except (OSError, TypeError):
        source = type(model).__qualname__.encode()
    return xxhash.xxh3_64_hexdigest(source)


def folder_digest(folder: str | Path) -> str:
    """xxh3 of every file under ``folder`` (names and bytes): a quantized artifact's identity."""
    h = xxhash.xxh3_128()
    root = Path(folder)
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(root)).encode() + b"\0")
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()


def options_json(config: Any, extra: dict[str, Any] | None = None) -> str:
    """The options part: every field of ``config`` (a dataclass) but ``compile_cache`` and ``warmup``
    (neither changes the program), plus ``extra`` (e.g. a quantized artifact's digest)."""
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
              if f.name not in ("compile_cache", "warmup")}
    fields.update(extra or {})
    return json.dumps(fields, sort_keys=True, default=repr)


def key_parts(model: torch.nn.Module, device: torch.device, options: str,
              versions_: dict[str, str] | None = None) -> KeyParts:
    """The key parts of ``model`` (its live weights, config and code) compiled with ``options`` on ``device``."""
    hf = getattr(model, "config", None)
    facts = {k: v for k, v in (hf.to_dict() if hf is not None else {}).items()
             if not k.startswith("_") and k != "transformers_version"}
    return KeyParts(weights=weights_digest(model),
                    model_config=json.dumps(facts, sort_keys=True, default=str),
                    model_code=_model_code(model), options=options,
                    versions=json.dumps(versions_ if versions_ is not None else versions(), sort_keys=True),
                    isa=isa(device))
