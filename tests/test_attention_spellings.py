"""attention_to_paged on the ways families spell the same attention, and a clear error where it cannot.

Each spelling is registered as a Hugging Face attention function (``AttentionInterface``) and a tiny
seeded Llama is built with it, so HF eager runs exactly that code: the compiled model's teacher-forced
logits must match HF's (fp32, 1e-4), every layer must have been rewritten, and a spelling the pass
cannot read must fail with a ``PassError`` naming the layers. Spellings: the scale on q, on k or on kᵀ
right at the product; ``einsum`` for both products; ``bmm`` over [B·H, T, D] views with a boolean mask
applied by ``where(mask, s, finfo.min)``; ``masked_fill`` with the hidden keys; XGLM's
``max(s + mask, finfo.min)`` clamp runs as a family (test_families.py: ``xglm``, whose sinusoidal
positions also cap a step's tokens; see test_capture_bound below).
"""
from __future__ import annotations

import warnings

import pytest
import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask, sdpa_mask
from transformers.models.llama.modeling_llama import repeat_kv

from conftest import FAMILIES, build_model
from devin_compile import optimize
from devin_compile.pipeline import PassError

ATOL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _kv(module, key, value):
    return repeat_kv(key, module.num_key_value_groups), repeat_kv(value, module.num_key_value_groups)


def _finish(probs, v):
    return torch.matmul(probs, v).transpose(1, 2).contiguous(), probs


def scale_on_q(module, query, key, value, attention_mask, scaling, dropout=0.0, **_):
    k, v = _kv(module, key, value)
    scores = torch.matmul(query * scaling, k.transpose(2, 3)) + attention_mask
    return _finish(torch.softmax(scores, dim=-1), v)


def scale_on_k(module, query, key, value, attention_mask, scaling, dropout=0.0, **_):
    k, v = _kv(module, key, value)
    scores = torch.matmul(query, (k * scaling).transpose(2, 3)) + attention_mask
    return _finish(torch.softmax(scores, dim=-1), v)


def scale_on_kt(module, query, key, value, attention_mask, scaling, dropout=0.0, **_):
    k, v = _kv(module, key, value)
    scores = torch.matmul(query, k.transpose(2, 3) / (1.0 / scaling)) + attention_mask
    return _finish(torch.softmax(scores, dim=-1), v)


def einsum_products(module, query, key, value, attention_mask, scaling, dropout=0.0, **_):
    k, v = _kv(module, key, value)
    scores = torch.einsum("bhqd,bhkd->bhqk", query, k) * scaling + attention_mask
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("bhqk,bhkd->bhqd", probs, v).transpose(1, 2).contiguous(), probs


def bmm_where(module, query, key, value, attention_mask, scaling, dropout=0.0, **_):
    """Boolean mask (True: visible) applied by where(); products by bmm over [B·H, T, D] views."""
    k, v = _kv(module, key, value)
    B, H, T, D = query.shape
    scores = torch.bmm(query.reshape(B * H, T, D), k.reshape(B * H, T, D).transpose(1, 2)) * scaling
    scores = torch.where(attention_mask, scores.view(B, H, T, T), torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores.view(B * H, T, T), dim=-1)
    return torch.bmm(probs, v.reshape(B * H, T, D)).view(B, H, T, D).transpose(1, 2).contiguous(), probs


def masked_fill_hidden(module, query, key, value, attention_mask, scaling, dropout=0.0, **_):
    k, v = _kv(module, key, value)
    scores = torch.matmul(query, k.transpose(2, 3)) * scaling
    scores = scores.masked_fill(~attention_mask, float("-inf"))
    return _finish(torch.softmax(scores, dim=-1), v)


def manual_softmax(module, query, key, value, attention_mask, scaling, dropout=0.0, **_):
    """Softmax written out (exp / sum): no softmax node, nothing for the pass to match."""
    k, v = _kv(module, key, value)
    scores = torch.matmul(query, k.transpose(2, 3)) * scaling + attention_mask
    e = torch.exp(scores - scores.amax(-1, keepdim=True))
    return _finish(e / e.sum(-1, keepdim=True), v)


def bool_mask(*args, **kwargs):
    """SDPA's boolean mask (True: visible), always built (SDPA's own skips it for plain causal inputs)."""
    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


# spelling → the mask it reads (float additive: eager's; bool, True = visible)
SPELLINGS = {fn.__name__: (fn, mask) for fn, mask in [
    (scale_on_q, eager_mask), (scale_on_k, eager_mask), (scale_on_kt, eager_mask), (einsum_products, eager_mask),
    (bmm_where, bool_mask), (masked_fill_hidden, bool_mask), (manual_softmax, eager_mask),
]}


def _model(name: str):
    fn, mask = SPELLINGS[name]
    impl = f"devin_test_{name}"
    AttentionInterface.register(impl, fn)
    ALL_MASK_ATTENTION_FUNCTIONS.register(impl, mask)
    fam = FAMILIES["llama"]
    return build_model(fam.model_type, fam.config_kwargs(), impl)


def _ids() -> torch.Tensor:
    return torch.randint(3, 256, (1, 29), generator=torch.Generator().manual_seed(4))


@pytest.mark.parametrize("name", [n for n in SPELLINGS if n != "manual_softmax"])
def test_spelling_compiles_with_parity(name):
    model = _model(name)
    ids = _ids()
    with torch.no_grad():
        ref = model(ids).logits[0]
        eager = build_model("llama", FAMILIES["llama"].config_kwargs(), "eager")(ids).logits[0]
    torch.testing.assert_close(ref, eager, atol=ATOL, rtol=0)  # the spelling is the same attention
    opt = optimize(model, attention_backend="torch_reference", num_kv_blocks=16)
    paged = [n for n in opt.program.graphs["prefill"].graph.nodes
             if n.op == "call_function" and n.target == torch.ops.devin.paged_attention.default]
    assert len(paged) == 2
    diff = (opt(ids).logits[0] - ref).abs().max().item()
    assert diff <= ATOL, f"{name}: max abs logit diff {diff:.2e}"


def test_unmatched_spelling_names_the_layers():
    with pytest.raises(PassError, match=r"rewrote 0 of 2 attention layers.*m\.model\.layers\.0\.self_attn"):
        optimize(_model("manual_softmax"), attention_backend="torch_reference", num_kv_blocks=16)


def test_capture_bound_caps_the_steps():
    """XGLM grows its sinusoidal table past 512 + 2 positions, so its graph holds steps of at most 512
    tokens: capture records the bound, the scheduler and the decode buckets are capped at it, a longer
    step is refused, and a full-sequence forward runs in steps within it."""
    fam = FAMILIES["xglm"]
    opt = optimize(build_model(fam.model_type, fam.config_kwargs(), "eager"), attention_backend="torch_reference",
                   num_kv_blocks=160, max_num_batched_tokens=4096, decode_buckets=(1, 8, 1024))
    assert opt.info.max_step_tokens == 512
    assert opt.optimize_config.scheduler.max_num_batched_tokens == 512 and opt.program.decode_buckets == (1, 8)
    runner = opt.engine.runner
    with pytest.raises(RuntimeError, match="a step of 513 tokens, but this model's graph holds at most 512"):
        runner.run([5] * 513, list(range(513)), list(range(513)), [513], [513], [list(range(33))], [512])
    runner.max_step_tokens = 16  # a full-sequence forward then runs as chunks over the cached ones
    ids = _ids()
    chunked = opt(ids).logits[0]
    runner.max_step_tokens = 512
    torch.testing.assert_close(chunked, opt(ids).logits[0], atol=ATOL, rtol=0)
