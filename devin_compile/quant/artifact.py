"""A quantized model on disk: ``quantized.safetensors`` + ``quant_config.json`` (no pickle).

Tensors, per decoder linear ``NAME`` (HF module name), and for the output head (``lm_head``)
when it was quantized too (``head`` in the JSON)::

    NAME.qweight    uint8 [N, ceil(K/2)]  two 4-bit values a byte, even column low (see backends.int4.format)
    NAME.scale      fp32  [N, G]
    NAME.minv       fp32  [N, G]
    NAME.in_scale   fp32  [K]   (AWQ only) the quantized weight is W · diag(in_scale)
    NAME.row_scale  fp32  [N]   (AWQ only) ... and diag(row_scale) · W
    NAME.fp8_weight float8_e4m3fn [N, K]  (FP8 tier) e4m3 codes of the same weight (backends.fp8.format)
    NAME.fp8_scale  fp32  [N]   (FP8 tier) per-row scales
    HEAD.int8_weight int8 [N, K]  (``lm_head="int8"``, ``int8_head`` in the JSON) the head's INT8 values
    HEAD.int8_scale fp32  [N]   ... and its per-row scales (backends.int8.format)
    override.PARAM  model dtype   a replacement for an HF parameter (AWQ-scaled norm weights)

``quant_config.json`` holds the format name and version, the method, bits, requested group
size and the options it was made with (target, kernel, ...), the model's fingerprint
(:func:`~devin_compile.quant.calibration.model_fingerprint`), and per linear its shape,
group size (and why it differs from the requested one), output error and signal, and estimated
loss increase (null when the calibration had no output gradients), and for the FP8 tier
(``"fp8": true``) the same two statistics of its rounding (``fp8_err``, ``fp8_loss_delta``).

:func:`load` checks everything against the model: format and version, fingerprint, every
tensor present with the shape and dtype the JSON and the model imply, q values in range
(no e4m3 NaN codes, finite scales);
anything wrong is a ``ValueError`` naming the tensor, never silent garbage.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..backends.fp8 import format as fp8_fmt
from ..backends.int4 import format as fmt
from ..backends.int8 import format as int8_fmt
from .model_linears import check_fingerprint, output_head, quantizable_linears
from .result import Int8Head, QLinear, QuantResult

TENSORS_FILE = "quantized.safetensors"
CONFIG_FILE = "quant_config.json"
FORMAT = "devin-compile-int4"
VERSION = 1


def save(result: QuantResult, out_dir: str | os.PathLike) -> Path:
    from safetensors.torch import save_file

    result.check_tensors("saving a quantized model")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    layers = {}
    for name, ql in result.linears.items():
        tensors[f"{name}.qweight"] = fmt.pack_nibbles(ql.q)
        tensors[f"{name}.scale"] = ql.scale.float().contiguous()
        tensors[f"{name}.minv"] = ql.minv.float().contiguous()
        if ql.in_scale is not None:
            tensors[f"{name}.in_scale"] = ql.in_scale.float().clone()  # q/k/v share one: safetensors wants copies
        if ql.row_scale is not None:
            tensors[f"{name}.row_scale"] = ql.row_scale.float().clone()
        layers[name] = {"shape": list(ql.shape), "group_size": ql.group_size, "group_note": ql.group_note,
                        "err": ql.err, "signal": ql.signal, "loss_delta": ql.loss_delta,
                        "in_scale": ql.in_scale is not None, "row_scale": ql.row_scale is not None,
                        "fp8": ql.fp8_q is not None}
        if ql.fp8_q is not None:
            tensors[f"{name}.fp8_weight"] = ql.fp8_q.contiguous().view(torch.float8_e4m3fn)
            tensors[f"{name}.fp8_scale"] = ql.fp8_scale.float().contiguous()
            layers[name].update(fp8_err=ql.fp8_err, fp8_loss_delta=ql.fp8_loss_delta)
    head8 = result.int8_head
    if head8 is not None:
        tensors[f"{head8.name}.int8_weight"] = head8.q.contiguous()
        tensors[f"{head8.name}.int8_scale"] = head8.scale.float().contiguous()
    for pname, value in result.overrides.items():
        tensors[f"override.{pname}"] = value.contiguous()
    meta = {"format": FORMAT, "version": VERSION, "method": result.method, "bits": result.bits,
            "group_size": result.group_size, "config": result.config, "fingerprint": result.fingerprint,
            "seconds": result.seconds, "calib": result.calib, "notes": result.notes, "linears": layers,
            "overrides": sorted(result.overrides), "groups": result.groups, "head": result.head,
            "int8_head": None if head8 is None else {"name": head8.name, "shape": list(head8.dims), "err": head8.err,
                                                     "signal": head8.signal, "loss_delta": head8.loss_delta}}
    save_file(tensors, str(out / TENSORS_FILE), metadata={"format": FORMAT, "version": str(VERSION)})
    (out / CONFIG_FILE).write_text(json.dumps(meta, indent=1, default=str))
    return out


def load(path: str | os.PathLike, model: torch.nn.Module) -> QuantResult:
    """Read an artifact written by :func:`save` and check it against ``model``."""
    p = Path(path)
    meta, tensors = _read_files(p)
    check_fingerprint(meta["fingerprint"], model, f"quantized model {p}")
    head = meta.get("head")
    if head is not None and (output_head(model) or ("",))[0] != head:
        raise ValueError(f"quantized model {p} quantizes the output head {head!r}, which this model lacks")
    lins = quantizable_linears(model, lm_head=head is not None)
    layers = meta["linears"]
    unknown = sorted(set(layers) - set(lins))
    if unknown:
        raise ValueError(f"quantized model {p} has linears this model lacks, e.g. {unknown[:3]}")
    linears = {name: _read_linear(tensors, name, info, lins[name]) for name, info in layers.items()}
    overrides = _read_overrides(tensors, meta.get("overrides", []), model)
    return QuantResult(meta["method"], int(meta["bits"]), int(meta["group_size"]), linears, overrides,
                       meta["fingerprint"], config=meta.get("config", {}), seconds=float(meta.get("seconds", 0.0)),
                       calib=meta.get("calib", {}), notes=list(meta.get("notes", [])),
                       groups=[list(g) for g in meta.get("groups", [])], head=head,
                       int8_head=_read_int8_head(tensors, meta.get("int8_head"), model))


@dataclass
class _Tensors:
    """An artifact's tensors, read with checks whose errors name the artifact and the tensor."""
    path: Path
    tensors: dict[str, torch.Tensor]

    def get(self, name: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        t = self.tensors.get(name)
        if t is None:
            raise ValueError(f"quantized model {self.path} is missing tensor {name!r}")
        if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
            raise ValueError(f"quantized model {self.path}: tensor {name!r} is {t.dtype}{list(t.shape)}, "
                             f"expected {dtype}{list(shape)}")
        return t


def read_config(path: str | os.PathLike) -> dict:
    """The checked ``quant_config.json`` of the artifact in ``path`` (both files present, the JSON
    readable, of this format and version, with the keys :func:`load` reads); cheap, no tensors."""
    p = Path(path)
    if not p.is_dir() or not (p / CONFIG_FILE).exists() or not (p / TENSORS_FILE).exists():
        raise FileNotFoundError(f"{p} is not a quantized-model directory (needs {CONFIG_FILE} and {TENSORS_FILE}; "
                                "make one with `devin-compile quantize run`)")
    try:
        meta = json.loads((p / CONFIG_FILE).read_text())
    except (json.JSONDecodeError, OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{p / CONFIG_FILE} is corrupted: {e}; write the artifact again with "
                         "`devin-compile quantize run`") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ValueError(f"{p / CONFIG_FILE} is not a version-{VERSION} {FORMAT} artifact")
    bad = _malformed(meta)
    if bad:
        raise ValueError(f"{p / CONFIG_FILE} is corrupted: {', '.join(bad)} missing or malformed; write the "
                         "artifact again with `devin-compile quantize run`")
    return meta


def _malformed(meta: dict) -> list[str]:
    """The keys of an artifact's JSON that :func:`load` needs and that are missing or of the wrong kind."""
    kinds = {"method": str, "bits": int, "group_size": int, "fingerprint": dict, "linears": dict}
    bad = [k for k, kind in kinds.items() if not isinstance(meta.get(k), kind)]
    for name, info in (meta["linears"] if "linears" not in bad else {}).items():
        if not isinstance(info, dict):
            bad.append(f"linears.{name}")
            continue
        need = {"shape", "group_size", "err", "signal"} | ({"fp8_err"} if info.get("fp8") else set())
        if not need <= set(info):
            bad.append(f"linears.{name}")
    return bad[:4]


def _read_files(p: Path) -> tuple[dict, _Tensors]:
    """The JSON (:func:`read_config`) and the tensors of the artifact in ``p``."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    meta = read_config(p)
    try:
        tensors = load_file(str(p / TENSORS_FILE))
    except (SafetensorError, OSError, RuntimeError) as e:
        raise ValueError(f"{p / TENSORS_FILE} is corrupted or truncated: {e}") from None
    return meta, _Tensors(p, tensors)


def _read_linear(t: _Tensors, name: str, info: dict, lin: torch.nn.Linear) -> QLinear:
    """Linear ``name``'s quantized weights (INT4, and FP8 when stored), checked against ``lin``."""
    p = t.path
    n, k = lin.out_features, lin.in_features
    if list(info["shape"]) != [n, k]:
        raise ValueError(f"quantized model {p}: {name} has shape {info['shape']}, the model's is {[n, k]}")
    g = int(info["group_size"])
    ng = fmt.num_groups(k, g)
    q = fmt.unpack_nibbles(t.get(f"{name}.qweight", (n, (k + 1) // 2), torch.uint8), k)
    if q.max() > fmt.QMAX:  # unreachable for nibbles; kept for the format's invariant
        raise ValueError(f"quantized model {p}: {name}.qweight has values above {fmt.QMAX}")
    scale = t.get(f"{name}.scale", (n, ng), torch.float32)
    minv = t.get(f"{name}.minv", (n, ng), torch.float32)
    if not (torch.isfinite(scale).all() and torch.isfinite(minv).all()):
        raise ValueError(f"quantized model {p}: {name} has non-finite scales or zeros")
    s_in = t.get(f"{name}.in_scale", (k,), torch.float32) if info.get("in_scale") else None
    s_row = t.get(f"{name}.row_scale", (n,), torch.float32) if info.get("row_scale") else None
    loss_delta = info.get("loss_delta")
    ql = QLinear(q, scale, minv, g, info.get("group_note", ""), float(info["err"]),
                 float(info["signal"]), s_in, s_row, None if loss_delta is None else float(loss_delta))
    if info.get("fp8"):
        q8 = t.get(f"{name}.fp8_weight", (n, k), torch.float8_e4m3fn).view(torch.uint8)
        s8 = t.get(f"{name}.fp8_scale", (n,), torch.float32)
        if fp8_fmt.has_nan_codes(q8) or not torch.isfinite(s8).all():
            raise ValueError(f"quantized model {p}: {name} has NaN FP8 codes or non-finite FP8 scales")
        d8 = info.get("fp8_loss_delta")
        ql.fp8_q, ql.fp8_scale, ql.fp8_err = q8, s8, float(info["fp8_err"])
        ql.fp8_loss_delta = None if d8 is None else float(d8)
    return ql


def _read_int8_head(t: _Tensors, info: dict | None, model: torch.nn.Module) -> Int8Head | None:
    """The INT8 head the JSON names (``int8_head``), checked against ``model``'s output head."""
    if info is None:
        return None
    found = output_head(model)
    if not isinstance(info, dict) or found is None or info.get("name") != found[0]:
        raise ValueError(f"quantized model {t.path} has an INT8 output head {info!r}, which this model lacks "
                         "(its head is not that linear)")
    name, lin = found
    n, k = lin.out_features, lin.in_features
    q = t.get(f"{name}.int8_weight", (n, k), torch.int8)
    scale = t.get(f"{name}.int8_scale", (n,), torch.float32)
    if int(q.min()) < -int8_fmt.INT8_MAX or not (torch.isfinite(scale).all() and (scale > 0).all()):
        raise ValueError(f"quantized model {t.path}: {name} has INT8 values of -128 or scales that are not "
                         "finite and positive")
    return Int8Head(name, q, scale, (n, k), info.get("err"), info.get("signal"), info.get("loss_delta"))


def _read_overrides(t: _Tensors, names: list[str], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The replacement parameters ``names`` (AWQ-scaled norm weights), checked against ``model``'s."""
    params = dict(model.named_parameters())
    overrides = {}
    for pname in names:
        if pname not in params:
            raise ValueError(f"quantized model {t.path} overrides parameter {pname!r}, which this model lacks")
        value = t.tensors.get(f"override.{pname}")
        if value is None or tuple(value.shape) != tuple(params[pname].shape) or not value.is_floating_point():
            raise ValueError(f"quantized model {t.path}: tensor 'override.{pname}' is missing or is not a float "
                             f"tensor of shape {list(params[pname].shape)}")
        overrides[pname] = value
    return overrides
