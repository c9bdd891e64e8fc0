"""A compiled program on disk: its graphs' code and tables in ``program.pkl``, the weights the
passes made in ``tensors.pt``, and the model's own weights by name, re-bound to the live model.

What is written (:func:`save`): each graph of the program as a GraphModule over only the tensors it
reads (``torch.fx``'s own pickling: the generated code, not the graph: reading it back re-traces
that code), the program's tables (decode and CUDA-Graph buckets), the :class:`ModelInfo`, the pass
report and the passes' outputs. Tensors are kept out of the pickle (persistent ids), as one of:

- ``("model", name, offset, size, stride)``: a view of the model's parameter or buffer ``name``
  (the same storage at ``offset`` elements from the parameter's own): re-bound to the live tensor,
  so nothing the model already holds is written or held twice;
- ``("own", i)``: a strided tensor the passes made (packed, fused, quantized), item ``i`` of
  ``tensors.pt`` (``torch.save``, which keeps views of one storage sharing it);
- ``("onednn", i, batch_hint)``: a oneDNN prepacked weight (an opaque layout torch cannot save):
  its dense values are item ``i``, prepacked again on load with the hint it was made with
  (each own tensor also names the device it was compiled for: offloaded layers stay on the CPU).

A program this cannot write (a tensor of another kind, a compiled callable from
``compile_decode``, an object pickle refuses) raises :class:`NotCacheable` naming it; the caller
then simply does not cache it. Reading needs the same model (the key says so: every weight byte)
on the device it was compiled for. No pass runs on a read: the C++ CPU kernels of the ``devin::``
ops the graphs call are registered here (:mod:`..ops.cpu_kernels`), as the passes that emit them do.
"""
from __future__ import annotations

import io
import pickle
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..capture import ModelInfo
from ..ops.cpu_kernels import load_for_graphs
from ..ops.onednn_linear import PREPACK_HINT, prepack_weight
from ..ops.upcast_linear import LeafTracer
from ..pipeline import Program

PROGRAM_FILE = "program.pkl"
TENSORS_FILE = "tensors.pt"


class NotCacheable(Exception):
    """The program holds something the compile cache cannot write (the message says what)."""


@dataclass
class Compiled:
    """What optimize() keeps of its capture and passes."""

    program: Program
    info: ModelInfo
    report: Any  # the PassManager's report
    outputs: Any  # PassOutputs
    quant_result: Any = None  # what OptimizedModel.quant_result holds (a QuantResult, or None)
    quant_identity: list | None = None  # [artifact fingerprint, QuantConfig repr] for the KV tiers' key


def _clean(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The same code over only the attributes its graph reads (no hooks export installed), and the tracer
    FX re-traces it with when unpickled where a pass set one (``upcast_linear``'s leaf tracer)."""
    out = torch.fx.GraphModule(gm, gm.graph, type(gm).__name__)
    if getattr(gm, "_tracer_cls", None) is LeafTracer:  # (export's own tracer is not one FX can rebuild)
        out._tracer_cls = LeafTracer
    return out


def _model_tensors(model: torch.nn.Module) -> dict[tuple, tuple[str, torch.Tensor]]:
    """The model's parameters and buffers by (device, storage pointer, dtype): first name wins."""
    out: dict[tuple, tuple[str, torch.Tensor]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if t.layout == torch.strided:
            out.setdefault((t.device, t.untyped_storage().data_ptr(), t.dtype), (name, t))
    return out


class _Writer(pickle.Pickler):
    def __init__(self, file, model: torch.nn.Module) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.by_storage = _model_tensors(model)
        self.own: list[torch.Tensor] = []
        self.index: dict[int, int] = {}  # id of a program tensor (kept alive in ``seen``) → its item
        self.seen: list[torch.Tensor] = []

    def _own(self, t: torch.Tensor) -> int:
        if id(t) not in self.index:
            self.index[id(t)] = len(self.own)
            self.seen.append(t)
            self.own.append(t.to_dense() if t.layout != torch.strided else t.detach())
        return self.index[id(t)]

    def persistent_id(self, obj: Any) -> tuple | None:
        if not isinstance(obj, torch.Tensor):
            return None
        if type(obj) not in (torch.Tensor, torch.nn.Parameter):
            raise NotCacheable(f"a tensor of type {type(obj).__name__}")
        if obj.layout != torch.strided:
            hint = getattr(obj, PREPACK_HINT, None)
            if not obj.is_mkldnn or hint is None:
                raise NotCacheable(f"a tensor with layout {obj.layout} that is not a known prepacked weight")
            return ("onednn", self._own(obj), hint, str(obj.device))
        found = self.by_storage.get((obj.device, obj.untyped_storage().data_ptr(), obj.dtype))
        if found is not None:
            name, base = found
            return ("model", name, obj.storage_offset() - base.storage_offset(), tuple(obj.shape), obj.stride())
        return ("own", self._own(obj), str(obj.device))


class _Reader(pickle.Unpickler):
    def __init__(self, file, model: torch.nn.Module, own: list[torch.Tensor]) -> None:
        super().__init__(file)
        self.live = model.state_dict(keep_vars=True)
        self.own = own

    def _on(self, i: int, device: str) -> torch.Tensor:
        """Item ``i`` on the device it was compiled for (offloaded layers stay on the CPU)."""
        if str(self.own[i].device) != device:
            self.own[i] = self.own[i].to(device)
        return self.own[i]

    def persistent_load(self, pid: tuple) -> torch.Tensor:
        kind = pid[0]
        if kind == "own":
            return self._on(pid[1], pid[2])
        if kind == "onednn":
            return prepack_weight(self._on(pid[1], pid[3]), pid[2])
        if kind == "model":
            _, name, offset, size, stride = pid
            base = self.live[name]
            view = torch.as_strided(base.detach(), size, stride, base.storage_offset() + offset)
            return torch.nn.Parameter(view, requires_grad=False) if isinstance(base, torch.nn.Parameter) else view
        raise pickle.UnpicklingError(f"unknown tensor reference {kind!r} in a compile-cache entry")


def save(folder: Path, compiled: Compiled, model: torch.nn.Module) -> None:
    """Write ``compiled`` into ``folder`` (tensors of ``model`` by reference); :class:`NotCacheable` when
    the program holds something this cannot write."""
    program = compiled.program
    if program.decode_callables:
        raise NotCacheable("compiled decode callables (compile_decode)")
    state = {"graphs": {name: _clean(gm) for name, gm in program.graphs.items()},
             "decode_buckets": program.decode_buckets, "cuda_graph_buckets": program.cuda_graph_buckets,
             "info": compiled.info, "report": compiled.report, "outputs": compiled.outputs,
             "quant_result": compiled.quant_result, "quant_identity": compiled.quant_identity}
    buf = io.BytesIO()
    writer = _Writer(buf, model)
    try:
        writer.dump(state)
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        raise NotCacheable(f"pickle refused it ({type(e).__name__}: {e})") from e
    (folder / PROGRAM_FILE).write_bytes(buf.getvalue())
    torch.save([t.to("cpu") for t in writer.own], folder / TENSORS_FILE)


def load(folder: Path, model: torch.nn.Module) -> Compiled:
    """Read the entry in ``folder`` back, its model references bound to ``model``'s live tensors and
    its own tensors on the devices they were compiled for."""
    # Memory-mapped (copy-on-write): pages are read as the first steps touch them, and processes
    # that load one entry share them.
    own = torch.load(folder / TENSORS_FILE, map_location="cpu", weights_only=True, mmap=True)
    with open(folder / PROGRAM_FILE, "rb") as f, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # (pytree's LeafSpec notice while re-tracing the code)
        state = _Reader(f, model, own).load()
    program = Program(state["graphs"], decode_buckets=state["decode_buckets"],
                      cuda_graph_buckets=state["cuda_graph_buckets"])
    load_for_graphs(program.graphs.values())  # no pass ran to register the ops' C++ kernels
    return Compiled(program, state["info"], state["report"], state["outputs"], state["quant_result"],
                    state["quant_identity"])
