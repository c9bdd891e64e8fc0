"""The C++ CPU kernels of the ``devin::`` ops a compiled program calls: :func:`load_for_graphs`.

A pass registers an op's C++ CPU kernel when it emits the op (each op module's ``load_cpu_kernel``);
until then the op's Python kernel serves every CPU call: the same values, several times slower (the
packed output head's Python kernel unpacks its whole weight every step). A program read back from the
compile cache ran no pass, so its loader registers the kernels of every op its graphs call here.
Attention kernels are not listed: the attention backend registers its own when the engine selects it.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch


def kernel_loaders() -> dict[str, Callable[[], bool]]:
    """Op name (``devin::name``) → the function that builds (once) and registers its C++ CPU kernel."""
    from ..backends.fp8 import cpu_fp8_op
    from ..backends.int4 import cpu_int4_op
    from . import moe_experts, packed_gemm_linear, rms_norm, rotary_heads, silu_mul

    return {"packed_gemm_linear": packed_gemm_linear.load_cpu_kernel,
            "packed_embedding": packed_gemm_linear.load_cpu_kernel,
            "moe_experts": moe_experts.load_cpu_kernel, "silu_mul": silu_mul.load_cpu_kernel,
            "rms_norm": rms_norm.load_cpu_kernel, "add_rms_norm": rms_norm.load_cpu_kernel,
            "rotary_heads": rotary_heads.load_cpu_kernel,
            "int4_linear": cpu_int4_op.load, "fp8_linear": cpu_fp8_op.load}


def devin_ops(graphs: Iterable[torch.fx.GraphModule]) -> set[str]:
    """The names of the ``devin::`` ops the graphs call (``add_rms_norm``, ...)."""
    names = set()
    for gm in graphs:
        for node in gm.graph.nodes:
            schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
            if schema is not None and schema.name.startswith("devin::"):
                names.add(schema.name.split("::", 1)[1])
    return names


def load_for_graphs(graphs: Iterable[torch.fx.GraphModule]) -> list[str]:
    """Register the C++ CPU kernel of every ``devin::`` op the graphs call that has one (built the
    first time, then cached on disk); the names of the ops whose kernel is registered."""
    loaders = kernel_loaders()
    loaded = []
    for name in sorted(devin_ops(graphs)):
        if name in loaders and loaders[name]():
            loaded.append(name)
    return loaded
