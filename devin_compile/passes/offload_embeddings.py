"""offload_embeddings: run the token embedding and/or lm_head on the CPU, the rest on the accelerator.

Pattern → replacement (per module named in ``offload_layers``)::

    embedding(W, ids)         →  to(embedding(W_cpu, to(ids, cpu)), device)
    linear(h, W_head[, b])    →  to(linear(to(h, cpu), W_head_cpu[, b_cpu]), device)

The embedding table is looked up on the CPU and only the rows of this step's tokens
travel to the device; for lm_head only the hidden states of the sampled positions travel
to the CPU (the graphs compute lm_head only at ``logits_indices``), and the logits come
back. Device memory saved: vocab x hidden x bytes for each offloaded table; tied
weights (one tensor for both) stay one tensor, on the CPU, and are counted once.

Module names are the model's own (``model.get_input_embeddings()`` /
``get_output_embeddings()`` attribute names, e.g. ``embed_tokens`` and ``lm_head``); an
unknown name is a ``ValueError`` listing the valid ones. Skipped when the model is already
on the CPU (nothing to move). A head or tied embedding that assign_precision quantized
(``devin::int8_linear`` / ``int8_embedding``, or INT4) is a ``PassError`` naming ``lm_head=False``
(not moved yet). Invariant: logits are unchanged up to the float rounding of
the CPU kernels (identical on CPU).
"""
from __future__ import annotations

import torch
import torch.fx

from ..graph_utils import is_call, is_logits_linear, reaches_output
from ..pipeline import Pass, PassContext, PassError, PassResult, Program

aten = torch.ops.aten


def offloadable_modules(model: torch.nn.Module) -> dict[str, str]:
    """{module attribute name → role} for the model's input embedding and output head."""
    names = {}
    roles = (("embedding", model.get_input_embeddings()), ("lm_head", model.get_output_embeddings()))
    for role, mod in roles:
        if mod is None:
            continue
        for name, m in model.named_modules():
            if m is mod:
                names[name.rsplit(".", 1)[-1]] = role
                break
    return names


def check_offload_layers(model: torch.nn.Module, layers) -> dict[str, str]:
    """Validate ``offload_layers`` names against the model; returns {name: role}."""
    valid = offloadable_modules(model)
    if isinstance(layers, str) or not all(isinstance(x, str) for x in layers):
        raise ValueError(f"offload_layers must be a list of module names, e.g. {sorted(valid)}")
    unknown = [x for x in layers if x not in valid]
    if unknown:
        raise ValueError(f"offload_layers: no module named {unknown} in {type(model).__name__}; "
                         f"valid names: {sorted(valid)}")
    return {x: valid[x] for x in layers}


class OffloadEmbeddings(Pass):
    name = "offload_embeddings"
    requires = ("split_phases",)

    def __init__(self, roles: set[str], force: bool = False) -> None:
        super().__init__()
        self.roles = set(roles)
        self.force = force  # rewrite even when the model is on the CPU (tests the rewrite there)

    def skip_reason(self, program: Program, ctx: PassContext) -> str | None:
        if not self.roles:
            return "no modules to offload"
        if ctx.info.device.type == "cpu" and not self.force:
            return "model is already on the CPU"
        return None

    def run(self, program: Program, ctx: PassContext) -> PassResult:
        device = ctx.info.device
        moved: dict[int, torch.Tensor] = {}  # device tensor id → its CPU copy (shared across graphs, tied once)
        matches, notes = 0, []
        for phase, gm in program.graphs.items():
            found = set()
            for node in list(gm.graph.nodes):
                if "embedding" in self.roles and is_call(node, aten.embedding.default) and node.args[0].op == "get_attr":
                    _offload_embedding(gm, node, device, moved)
                    found.add("embedding")
                elif "lm_head" in self.roles and is_logits_linear(node):
                    _offload_head(gm, node, device, moved)
                    found.add("lm_head")
            missing = self.roles - found
            quantized = quantized_roles(gm) & missing
            if quantized:
                raise PassError(f"offload_layers: the {' and '.join(sorted(quantized))} of this model is quantized "
                                "(devin::int8/int4 ops), which offload_embeddings does not move to the CPU yet; "
                                "keep the head in the model dtype (quantization={..., 'lm_head': False}) or drop "
                                f"{sorted(quantized)} from offload_layers")
            if missing:
                raise PassError(f"offload_embeddings: {phase} graph has no {sorted(missing)} node to offload "
                                "(expected aten.embedding on the input ids / the linear producing the logits)")
            matches += len(found)
        saved = sum(t.numel() * t.element_size() for t in moved.values())
        if device.type != "cpu":
            for gm in program.graphs.values():  # drop device copies nobody reads any more
                gm.graph.eliminate_dead_code()
                gm.delete_all_unused_submodules()
        notes.append(f"{sorted(self.roles)} on CPU; device memory saved {saved / 2**20:.1f} MiB")
        return PassResult(matches=matches, note="; ".join(notes))


def _op_name(node: torch.fx.Node) -> str:
    """``int8_linear`` for a call of ``devin::int8_linear``; "" for anything but a devin:: op call."""
    t = node.target
    if node.op != "call_function" or not isinstance(t, torch._ops.OpOverload) or t.namespace != "devin":
        return ""
    return t.name().split("::")[-1].split(".")[0]


def _is_linear(node: torch.fx.Node) -> bool:
    """A linear of any kind: ``aten.linear`` or a ``devin::*_linear`` kernel op."""
    return is_call(node, aten.linear.default) or _op_name(node).endswith("_linear")


def quantized_roles(gm: torch.fx.GraphModule) -> set[str]:
    """The roles whose op in ``gm`` is a quantized one (assign_precision's rewrites): a tied embedding reading
    the INT8/INT4 head, a quantized linear producing the logits."""
    roles = set()
    for n in gm.graph.nodes:
        name = _op_name(n)
        if name in ("int8_embedding", "int4_embedding"):
            roles.add("embedding")
        elif name in ("int8_linear", "int4_linear") and reaches_output(n, _is_linear):
            roles.add("lm_head")
    return roles


def _cpu_attr(gm: torch.fx.GraphModule, attr_node: torch.fx.Node, moved: dict) -> torch.fx.Node:
    t = getattr(gm, attr_node.target) if "." not in attr_node.target else gm.get_parameter(attr_node.target)
    key = id(t)
    if key not in moved:
        moved[key] = t.detach().to("cpu")
    name = "offload_cpu_" + attr_node.target.replace(".", "_")
    if not hasattr(gm, name):
        gm.register_buffer(name, moved[key], persistent=False)
    with gm.graph.inserting_after(attr_node):
        new = gm.graph.get_attr(name)
    new.meta = dict(attr_node.meta)
    return new


def _to(graph: torch.fx.Graph, x: torch.fx.Node, device: torch.device) -> torch.fx.Node:
    n = graph.call_function(aten._to_copy.default, (x,), {"device": device})
    if "val" in x.meta:
        n.meta["val"] = x.meta["val"]
    return n


def _offload_embedding(gm, node, device, moved) -> None:
    graph = gm.graph
    w_cpu = _cpu_attr(gm, node.args[0], moved)
    with graph.inserting_before(node):
        ids = _to(graph, node.args[1], torch.device("cpu"))
        emb = graph.call_function(aten.embedding.default, (w_cpu, ids, *node.args[2:]))
        emb.meta = dict(node.meta)
        back = _to(graph, emb, device)
    node.replace_all_uses_with(back)
    graph.erase_node(node)


def _offload_head(gm, node, device, moved) -> None:
    graph = gm.graph
    w_cpu = _cpu_attr(gm, node.args[1], moved)
    bias = node.args[2] if len(node.args) > 2 else None
    with graph.inserting_before(node):
        b_cpu = _cpu_attr(gm, bias, moved) if bias is not None and bias.op == "get_attr" else bias
        h = _to(graph, node.args[0], torch.device("cpu"))
        out = graph.call_function(aten.linear.default, (h, w_cpu, b_cpu) if b_cpu is not None else (h, w_cpu))
        out.meta = dict(node.meta)
        back = _to(graph, out, device)
    node.replace_all_uses_with(back)
    graph.erase_node(node)
