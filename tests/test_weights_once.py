"""Every weight is held once (issue 41): the optimized model keeps no second copy of a weight.

- the model's original tensors are released once the caller drops the model: the program, the engine
  and closures hold only their own (packed, quantized or compact) copies; each original storage is
  watched through the numpy array it was made from, whose weak reference dies with the last tensor
  that reads it;
- the tensors reachable from an ``OptimizedModel`` add up to the weights' bytes once: no dense copy
  beside a packed one (a tied embedding reads the packed output head), no dense copy of a quantized
  weight (long steps dequantize tiles), no quantized copy in ``quant_result``;
- long steps over tiles compute what the dense copies computed; the dequantizer writes torch's values.
"""
from __future__ import annotations

import gc
import weakref

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import devin_compile
from devin_compile.backends import dequant
from devin_compile.backends.fp8 import cpu_fp8_linear as c8
from devin_compile.backends.fp8 import format as f8
from devin_compile.backends.int4 import cpu_int4_linear as c4
from devin_compile.backends.int4 import format as fmt
from devin_compile.backends.native.build import VARIANTS
from devin_compile.ops import dequant_tiles
from devin_compile.quant import artifact, quantize_model
from devin_compile.quant.calibration import collect_stats
from devin_compile.weights import held_bytes, held_tensors

HAVE_TILES = dequant.available() and c4.available() and c8.available()
needs_tiles = pytest.mark.skipif(not HAVE_TILES, reason="no C compiler: the C kernels and dequantizer are not built")


def _tiny(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, initializer_range=0.05,
                      max_position_embeddings=256, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


def _watch(model: torch.nn.Module) -> dict[str, weakref.ref]:
    """Move every parameter onto a numpy array of its own (its bytes: numpy has no bf16) and return weak
    references to the arrays: one stays alive exactly as long as some tensor still reads that storage."""
    refs = {}
    for name, p in model.named_parameters():
        arr = p.detach().contiguous().view(torch.uint8).numpy().copy()
        p.data = torch.from_numpy(arr).view(p.dtype)
        refs[name] = weakref.ref(arr)
    return refs


@pytest.fixture(scope="module")
def artifact_dir(tmp_path_factory):
    model = _tiny()
    gen = torch.Generator().manual_seed(0)
    stats = collect_stats(model, [torch.randint(3, 300, (64,), generator=gen) for _ in range(4)], progress=False)
    res = quantize_model(model, stats, {"method": "rtn", "group_size": 64, "tiers": "int4,fp8", "progress": False})
    path = tmp_path_factory.mktemp("q")
    artifact.save(res, path)
    return str(path)


def _options(kind: str, artifact_dir: str, dtype: torch.dtype = torch.float32, **quant) -> dict:
    if kind == "dense":
        return {}
    tiers = {"int4": "int4", "fp8": "fp8", "mix": "int4,fp8"}[kind]
    q = {"tiers": tiers, **quant}
    if kind == "mix":  # budgets (of the model dtype's bytes) between all-INT4 and all-FP8
        q["target"] = {"memory_fraction": 0.2 if dtype == torch.float32 else 0.4}
    return {"quantized": artifact_dir, "quantization": q}


def _weight_bytes(opt) -> int:
    """Bytes of the tensors an OptimizedModel holds, the KV pool left out."""
    found = held_tensors(opt)
    pool = opt.engine.runner.kv_cache.data
    return held_bytes({k: v for k, v in found.items() if not any(t.data_ptr() == pool.data_ptr() for t in v
                                                                  if t.layout == torch.strided)})


def _expected_bytes(model: torch.nn.Module, opt) -> int:
    """The weights once: each quantized linear at its table bytes, every other parameter at its own."""
    table = opt.precision_table
    covered = {n for r in table for n in _expand(r["linear"])}
    rest = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
               if name.removesuffix(".weight") not in covered)
    return rest + sum(r["bytes"] for r in table)


def _expand(label: str) -> list[str]:
    head, *more = label.split("+")
    prefix = head.rpartition(".")[0]
    return [head] + [f"{prefix}.{leaf}" for leaf in more]


@pytest.mark.parametrize("kind,dtype", [("dense", torch.float32), ("int4", torch.float32), ("fp8", torch.float32),
                                        ("mix", torch.float32), ("dense", torch.bfloat16), ("mix", torch.bfloat16)])
def test_original_tensors_are_released_with_the_model(kind, dtype, artifact_dir):
    """(bf16: the tied head is packed for devin's kernel too, so the embedding reads it; INT4 scales are float32
    where the table counts them in the model dtype, a few KiB here)"""
    if kind != "dense" and not HAVE_TILES:
        pytest.skip("no C compiler: the quantized CPU kernels are not built")
    model = _tiny().to(dtype)
    ids = torch.randint(3, 300, (1, 20))
    with torch.no_grad():
        before = model(ids).logits
    refs = _watch(model)
    opt = devin_compile.optimize(model, num_kv_blocks=16, **_options(kind, artifact_dir, dtype))
    with torch.no_grad():  # the model still works: re-pointed parameters read the program's copies
        assert torch.equal(model(ids).logits, before)
    expected = _expected_bytes(model, opt)
    del model
    gc.collect()
    alive = sorted(name for name, ref in refs.items() if ref() is not None)
    assert alive == [], f"the optimized model keeps the original storage of {alive}"
    held = _weight_bytes(opt)
    # packed layouts pad rows to 16 (the 320-row head has none); a few KiB of small buffers besides
    assert held <= expected + (64 << 10), (held, expected)
    assert opt.generate([[5, 6, 7]], max_new_tokens=4)


def test_the_bound_catches_a_second_copy(artifact_dir):
    """The byte bound above is not vacuous: the explicit dense copies of ``dense_prefill=True`` break it."""
    if not HAVE_TILES:
        pytest.skip("no C compiler: the quantized CPU kernels are not built")
    model = _tiny()
    opt = devin_compile.optimize(model, num_kv_blocks=16, **_options("int4", artifact_dir, dense_prefill=True))
    assert any(n.kwargs.get("dense") is not None for gm in opt.program.graphs.values() for n in gm.graph.nodes
               if n.op == "call_function" and n.target == torch.ops.devin.int4_linear.default)
    assert _weight_bytes(opt) > _expected_bytes(model, opt) + (64 << 10)


@needs_tiles
def test_default_quantized_model_keeps_no_dense_copy(artifact_dir):
    model = _tiny()
    opt = devin_compile.optimize(model, num_kv_blocks=16, **_options("mix", artifact_dir))
    nodes = [n for gm in opt.program.graphs.values() for n in gm.graph.nodes if n.op == "call_function"
             and n.target in (torch.ops.devin.int4_linear.default, torch.ops.devin.fp8_linear.default)]
    assert {str(n.target).split(".")[1] for n in nodes} == {"int4_linear", "fp8_linear"}
    assert all(n.kwargs.get("dense") is None for n in nodes)
    assert all(next(v for k, v in n.kwargs.items() if k.startswith("max_")) > 0 for n in nodes)
    note = next(r.note for r in opt.pass_report.records if r.name == "assign_precision")
    assert "dequantized tiles" in note and "MiB dense copies" not in note
    assert opt.quant_result.tensors_released and all(ql.q is None for ql in opt.quant_result.linears.values())
    with pytest.raises(ValueError, match="keep_quant_result=True"):
        artifact.save(opt.quant_result, "/nonexistent")


@needs_tiles
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_steps_over_tiles_match_the_dense_copies(dtype, artifact_dir):
    """A prompt longer than the kernels' row limits runs every quantized linear over dequantized tiles,
    which compute what the dense copies of ``dense_prefill=True`` computed."""
    model = _tiny().to(dtype)
    ids = torch.randint(3, 300, (1, 90), generator=torch.Generator().manual_seed(3))
    tiles = devin_compile.optimize(model, num_kv_blocks=16, **_options("mix", artifact_dir, dtype))
    dense = devin_compile.optimize(model, num_kv_blocks=16, **_options("mix", artifact_dir, dtype, dense_prefill=True))
    assert {r["precision"] for r in tiles.precision_table} >= {"int4", "fp8"}
    a, b = tiles(ids).logits.float(), dense(ids).logits.float()
    tol = 1e-4 if dtype == torch.float32 else 3e-2 * b.abs().max().item()
    assert (a - b).abs().max().item() <= tol
    if dtype == torch.float32:  # (bf16: near-ties of a random tiny model may pick either token)
        prompt = ids[0, :40].tolist()
        assert tiles.generate([prompt], max_new_tokens=6) == dense.generate([prompt], max_new_tokens=6)


def _int4(n: int, k: int, g: int, seed: int = 0):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    q, s, m = fmt.rtn_quantize(w, g)
    return q, s, m, *c4.pack(q, s, m, g)


@needs_tiles
@pytest.mark.parametrize("variant", [v for v in VARIANTS if v in ("native", "avx2", "portable")])
@pytest.mark.parametrize("n,k,g", [(96, 128, 64), (37, 130, 32), (200, 96, 32)])
def test_dequantizer_writes_torchs_values(variant, n, k, g):
    """Both layouts of a tile (the packed GEMM's [blocks, K, 16] and the transposed weight [K, 16 blocks])
    hold exactly torch's dequantized values, in every activation dtype; rows past n are zeros."""
    if dequant.load(variant) is None:
        pytest.skip(f"the {variant} build is unavailable here")
    q, s, m, qw, sz = _int4(n, k, g)
    w8 = torch.randn(n, k, generator=torch.Generator().manual_seed(1))
    q8, s8 = f8.quantize(w8)
    tiles = [(dequant.Int4Tiles(qw, sz, g, n, k, variant), lambda dt: fmt.dequantize(q, s, m, g, dt)),
             (dequant.FP8Tiles(c8.pack(q8), s8, n, k, variant), lambda dt: f8.dequantize(q8, s8, dt))]
    nb = -(-n // 16)
    for fill, ref_of in tiles:
        for dt in (torch.float32, torch.bfloat16, torch.float16):
            ref = torch.nn.functional.pad(ref_of(dt), (0, 0, 0, nb * 16 - n))
            packed = torch.full((nb, k, 16), float("nan"), dtype=dt)
            fill(0, nb, packed, 16 * k, 16)
            assert torch.equal(packed.transpose(1, 2).reshape(nb * 16, k), ref), (type(fill).__name__, dt)
            part = torch.full((k, 32), float("nan"), dtype=dt)  # two blocks from the second one on
            fill(1, 2, part, 16, 32)
            assert torch.equal(part.t(), ref[16:48]), (type(fill).__name__, dt)


@needs_tiles
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tile_bytes", [dequant_tiles.TILE_BYTES, 1])
def test_tiled_linear_equals_a_dense_linear(dtype, tile_bytes):
    """One tile or one 16-row block per tile (tile_bytes=1), with and without bias, N not a multiple of 16."""
    n, k, g = 100, 128, 64
    q, s, m, qw, sz = _int4(n, k, g)
    x = torch.randn(2, 24, k).to(dtype)
    bias = torch.randn(n).to(dtype)
    w = fmt.dequantize(q, s, m, g, torch.float32)
    for b in (None, bias):
        got = dequant_tiles.tiled_linear(x, dequant.Int4Tiles(qw, sz, g, n, k), b, tile_bytes=tile_bytes)
        want = torch.nn.functional.linear(x.float(), w, None if b is None else b.float())
        assert got.shape == (2, 24, n) and got.dtype == dtype
        tol = 1e-4 if dtype == torch.float32 else 2e-2 * want.abs().max().item()
        assert (got.float() - want).abs().max().item() <= tol


@needs_tiles
def test_op_runs_tiles_above_the_limit_without_a_dense_copy(monkeypatch):
    """``devin::int4_linear`` without ``dense`` runs the C kernel up to ``max_int4_tokens`` rows and the tiles
    above (the op's C++ kernel hands those to the Python kernel); the tiles compute the same linear."""
    n, k, g = 96, 128, 64
    q, s, m, qw, sz = _int4(n, k, g)
    calls = []
    real = dequant_tiles.tiled_linear
    monkeypatch.setattr("devin_compile.ops.int4_linear.tiled_linear",
                        lambda *a, **kw: (calls.append(a[0].shape), real(*a, **kw))[1])
    x = torch.randn(10, k)
    few = torch.ops.devin.int4_linear(x[:4], qw, sz, g, n, "cpu_c", None, None, 4)
    many = torch.ops.devin.int4_linear(x, qw, sz, g, n, "cpu_c", None, None, 4)
    assert calls == [x.shape]
    assert torch.equal(few, torch.ops.devin.int4_linear(x[:4], qw, sz, g, n, "cpu_c"))
    want = x @ fmt.dequantize(q, s, m, g).t()
    assert (many - want).abs().max().item() <= 1e-4 and (few - want[:4]).abs().max().item() <= 1e-4


def test_bf16_tied_head_serves_the_embedding_and_the_logits():
    """A bf16 model's tied head is packed once, in bf16 pairs: the embedding looks rows up in it and the C tile
    (AVX512-BF16; whole 16-row tiles on AMX) computes the logits rows, equal to a float32 linear over the bf16 weight up to bf16 rounding."""
    from devin_compile.ops import packed_gemm_linear as pg

    if not (pg.load_cpu_kernel() and pg.serves_bf16()):
        pytest.skip("no AVX512-BF16 (or no C++ compiler): a bf16 head stays oneDNN-prepacked beside the embedding")
    model = _tiny().to(torch.bfloat16)
    opt = devin_compile.optimize(model, num_kv_blocks=16)
    targets = [n.target for gm in opt.program.graphs.values() for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.devin.packed_embedding.default in targets and torch.ops.aten.embedding.default not in targets
    assert targets.count(torch.ops.devin.packed_gemm_linear.default) == 2  # the head, in each graph
    w = model.lm_head.weight.detach()
    packed = pg.pack_weight(w)
    assert packed.shape == (20, 64, 16, 2) and torch.equal(pg.unpack_weight(packed, 320), w)
    ids = torch.tensor([[0, 5, 17, 299, 16]])
    assert torch.equal(torch.ops.devin.packed_embedding(packed, ids), torch.nn.functional.embedding(ids, w))
    bias = torch.randn(320).bfloat16()
    for rows in (1, 2, 3, 9, 16, 17, 40):  # 16, 17, 40: whole 16-row tiles through AMX where the CPU has it
        x = torch.randn(rows, w.shape[1]).bfloat16()
        for b in (None, bias):
            got = torch.ops.devin.packed_gemm_linear(x, packed, b, w.shape[0])
            want = x.float() @ w.float().t() + (0 if b is None else b.float())
            assert got.dtype == torch.bfloat16
            assert (got.float() - want).abs().max().item() <= 1e-2 * want.abs().max().item(), rows
