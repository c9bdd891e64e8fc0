"""The statistics calibration gathers (:class:`CalibrationStats`; what each holds: :mod:`.calibration`)
and their files.

Saved as ``stats.safetensors`` + ``calib.json`` (no pickle). Version 2 (:meth:`CalibrationStats.save`)
stores each [K, K] matrix as its exact fp32 diagonal plus its correlation matrix's upper triangle
in fixed point (:mod:`.stats_format`): 12 bits for ``hessian`` (what GPTQ and AWQ solve with),
8 bits for ``grad_hessian`` (its blend weight and loss estimates tolerate more); ``absmean`` and
``fisher`` stay fp32. SmolLM2-135M at the defaults: 128.2 MB instead of 809.0 MB. Version-1
directories (everything fp32) still load.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .model_linears import check_fingerprint, output_head, quantizable_linears
from .stats_format import decode_psd, encode_psd

STATS_FILE = "stats.safetensors"
META_FILE = "calib.json"
FORMAT_VERSION = 2  # 1: every tensor fp32; 2: the [K, K] matrices as diagonal + fixed-point correlations
HESSIAN_BITS = 12  # fixed-point bits of the stored correlations of ``hessian``
GRAD_HESSIAN_BITS = 8  # ... and of ``grad_hessian``


@dataclass
class CalibrationStats:
    hessian: dict[str, torch.Tensor]  # input key → [K, K] mean x xᵀ (fp32)
    absmean: dict[str, torch.Tensor]  # input key → [K] mean |x|
    linear_input: dict[str, str]  # linear module name → input key
    producer: dict[str, str]  # input key → norm module name that produced it (if any)
    tokens: int
    num_chunks: int
    chunk_len: int
    fingerprint: dict
    seconds: float = 0.0
    data: str = ""
    extra: dict = field(default_factory=dict)
    fisher: dict[str, torch.Tensor] = field(default_factory=dict)  # linear name → [N] mean (∂ℓ/∂y)²
    grad_hessian: dict[str, torch.Tensor] = field(default_factory=dict)  # input key → [K, K] (module doc)

    def save(self, out_dir: str | os.PathLike, hessian_bits: int = HESSIAN_BITS,
             grad_hessian_bits: int = GRAD_HESSIAN_BITS) -> int:
        """Write ``stats.safetensors`` + ``calib.json`` (format version 2, module doc) and return the
        statistics file's size in bytes. The matrices held here become the stored ones (what
        :meth:`load` gives back), so quantizing from this object and from the directory agree."""
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {f"{k}.absmean": v.contiguous() for k, v in self.absmean.items()}
        tensors.update({f"{k}.fisher": v.contiguous() for k, v in self.fisher.items()})
        for kind, mats, bits in (("hessian", self.hessian, hessian_bits),
                                 ("grad_hessian", self.grad_hessian, grad_hessian_bits)):
            for k in mats:
                diag, packed = encode_psd(mats[k], bits)
                tensors[f"{k}.{kind}.diag"], tensors[f"{k}.{kind}.corr"] = diag, packed
                mats[k] = decode_psd(diag, packed, bits)
        save_file(tensors, str(out / STATS_FILE))
        meta = {"format": "devin-compile-calibration", "version": FORMAT_VERSION, "inputs": sorted(self.hessian),
                "linear_input": self.linear_input, "producer": self.producer, "tokens": self.tokens,
                "num_chunks": self.num_chunks, "chunk_len": self.chunk_len, "fingerprint": self.fingerprint,
                "seconds": self.seconds, "data": self.data, "fisher": sorted(self.fisher),
                "grad_hessian": sorted(self.grad_hessian),
                "correlation_bits": {"hessian": hessian_bits, "grad_hessian": grad_hessian_bits}}
        (out / META_FILE).write_text(json.dumps(meta, indent=1))
        return (out / STATS_FILE).stat().st_size

    @classmethod
    def load(cls, path: str | os.PathLike, model: torch.nn.Module | None = None) -> "CalibrationStats":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        p = Path(path)
        if not (p / META_FILE).exists() or not (p / STATS_FILE).exists():
            raise FileNotFoundError(f"{p} is not a calibration directory (needs {META_FILE} and {STATS_FILE}; "
                                    "make one with `devin-compile quantize calibrate`)")
        try:
            meta = json.loads((p / META_FILE).read_text())
            tensors = load_file(str(p / STATS_FILE))
        except (json.JSONDecodeError, SafetensorError, OSError) as e:
            raise ValueError(f"calibration directory {p} is corrupted: {e}") from None
        version = meta.get("version")
        if meta.get("format") != "devin-compile-calibration" or version not in (1, FORMAT_VERSION):
            raise ValueError(f"{p / META_FILE} is not a version-1 or -{FORMAT_VERSION} devin-compile calibration file")
        bits = meta.get("correlation_bits", {})

        def matrix(k: str, kind: str) -> torch.Tensor | None:
            if version == 1:
                return tensors.get(f"{k}.{kind}")
            diag, packed = tensors.get(f"{k}.{kind}.diag"), tensors.get(f"{k}.{kind}.corr")
            if diag is None or packed is None:
                return None
            try:
                return decode_psd(diag, packed, int(bits[kind]))
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"calibration directory {p}: {k}.{kind} cannot be decoded ({e})") from None

        hessian, absmean = {}, {}
        for k in meta["inputs"]:
            h = matrix(k, "hessian")
            if h is None or f"{k}.absmean" not in tensors:
                raise ValueError(f"calibration directory {p} is missing the statistics of input {k!r}")
            hessian[k], absmean[k] = h, tensors[f"{k}.absmean"]
            kdim = absmean[k].shape[0]
            if tuple(hessian[k].shape) != (kdim, kdim):
                raise ValueError(f"calibration {p}: {k}.hessian has shape {tuple(hessian[k].shape)}, expected {(kdim, kdim)}")
        fisher = {}
        for name in meta.get("fisher", []):
            if f"{name}.fisher" not in tensors:
                raise ValueError(f"calibration directory {p} is missing the output-gradient statistics of {name!r}")
            fisher[name] = tensors[f"{name}.fisher"]
        grad_hessian = {}
        for k in meta.get("grad_hessian", []):
            hg = matrix(k, "grad_hessian") if k in hessian else None
            if hg is None or tuple(hg.shape) != tuple(hessian[k].shape):
                raise ValueError(f"calibration directory {p} is missing the gradient-weighted statistics of input {k!r}")
            grad_hessian[k] = hg
        stats = cls(hessian, absmean, meta["linear_input"], meta["producer"], meta["tokens"], meta["num_chunks"],
                    meta["chunk_len"], meta["fingerprint"], meta.get("seconds", 0.0), meta.get("data", ""),
                    fisher=fisher, grad_hessian=grad_hessian)
        if model is not None:
            stats.check_model(model, f"calibration {p}")
        return stats

    def check_model(self, model: torch.nn.Module, what: str) -> None:
        """A ``ValueError`` naming ``what`` unless these statistics were gathered on ``model``."""
        check_fingerprint(self.fingerprint, model, what)
        lins = quantizable_linears(model, lm_head=output_head(model) is not None)
        for name, key in self.linear_input.items():
            if name not in lins or lins[name].in_features != self.absmean[key].shape[0]:
                raise ValueError(f"{what}: linear {name!r} does not match the model")
        for name, f in self.fisher.items():
            if name not in lins or tuple(f.shape) != (lins[name].out_features,):
                raise ValueError(f"{what}: the output-gradient statistics of {name!r} do not match the model")
