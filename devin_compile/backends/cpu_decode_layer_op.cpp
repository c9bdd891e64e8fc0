// devin::cpu_decode_layer: one layer of a pure-decode step on CPU, in one dispatched call: write
// the step's new K/V rows into the paged pool, then attend (cpu_paged_decode.c's two kernels).
//
// The cpu_sdpa backend calls it for each layer of a step in which every sequence has one query;
// the step's rows / block tables / lengths / chunk are computed once per step in Python. Before
// this op the same two C kernels were reached through ctypes with ~55 Python-side arguments
// and checks per layer (~60 us of a decode step's ~95 us per layer on a 2-core CPU).
// Preconditions (checked by the caller once per step, re-checked cheaply here): one dtype
// (float32 / bf16 / fp16) for q, k, v and both pools; last dims contiguous; slots int64 [T],
// rows int64 [n], tables int32 [n, M], lens int32 [n].
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

extern "C" {
int devin_paged_decode_attention(const void *q, int64_t q_row_stride, int64_t q_head_stride, const int64_t *q_rows,
                                 const void *k_cache, int64_t k_block_stride, int64_t k_slot_stride,
                                 int64_t k_head_stride, const void *v_cache, int64_t v_block_stride,
                                 int64_t v_slot_stride, int64_t v_head_stride, const int32_t *tables,
                                 int64_t table_stride, const int32_t *lens, void *out, int64_t out_row_stride,
                                 int64_t out_head_stride, float *mass, int64_t mass_row_stride,
                                 int64_t mass_head_stride, int n, int num_kv_heads, int group, int head_dim,
                                 int v_head_dim, int block_size, float scale, int dtype, int num_threads, int chunk);
int devin_paged_write_kv(const void *k_new, int64_t kn_row_stride, int64_t kn_head_stride, const void *v_new,
                         int64_t vn_row_stride, int64_t vn_head_stride, const int64_t *slots, int n_tokens,
                         void *k_cache, int64_t k_block_stride, int64_t k_slot_stride, int64_t k_head_stride,
                         void *v_cache, int64_t v_block_stride, int64_t v_slot_stride, int64_t v_head_stride,
                         int num_kv_heads, int head_dim, int v_head_dim, int block_size, int64_t num_slots,
                         int elem_size);
}

namespace {

int dtype_code(c10::ScalarType t) {
    switch (t) {
        case c10::ScalarType::Float: return 0;
        case c10::ScalarType::BFloat16: return 1;
        case c10::ScalarType::Half: return 2;
        default: return -1;
    }
}

at::Tensor cpu_decode_layer(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, at::Tensor &k_cache,
                            at::Tensor &v_cache, const at::Tensor &slots, const at::Tensor &rows,
                            const at::Tensor &tables, const at::Tensor &lens, double scale, int64_t chunk) {
    const int code = dtype_code(q.scalar_type());
    TORCH_CHECK(code >= 0 && k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type() &&
                    k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
                "cpu_decode_layer: q, k, v and the pools need one dtype of float32/bf16/fp16");
    TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4,
                "cpu_decode_layer: q/k/v [T, H, D] and pools [blocks, block_size, Hkv, D]");
    TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1 && k_cache.stride(3) == 1 &&
                    v_cache.stride(3) == 1 && tables.stride(1) == 1,
                "cpu_decode_layer: last dims must be contiguous");
    TORCH_CHECK(slots.scalar_type() == at::kLong && rows.scalar_type() == at::kLong &&
                    tables.scalar_type() == at::kInt && lens.scalar_type() == at::kInt && slots.is_contiguous() &&
                    rows.is_contiguous() && lens.is_contiguous(),
                "cpu_decode_layer: slots/rows int64, tables/lens int32, contiguous");
    const int64_t T = q.size(0), hkv = k_cache.size(2), n = rows.size(0);
    TORCH_CHECK(k.size(0) == T && v.size(0) == T && slots.size(0) == T && k.size(1) == hkv && v.size(1) == hkv &&
                    k.size(2) == k_cache.size(3) && v.size(2) == v_cache.size(3) && q.size(1) % hkv == 0 &&
                    tables.size(0) == n && lens.size(0) == n,
                "cpu_decode_layer: shapes disagree");
    int rc = devin_paged_write_kv(k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0), v.stride(1),
                                  slots.data_ptr<int64_t>(), (int)T, k_cache.data_ptr(), k_cache.stride(0),
                                  k_cache.stride(1), k_cache.stride(2), v_cache.data_ptr(), v_cache.stride(0),
                                  v_cache.stride(1), v_cache.stride(2), (int)hkv, (int)k.size(2), (int)v.size(2),
                                  (int)k_cache.size(1), k_cache.size(0) * k_cache.size(1), (int)k.element_size());
    TORCH_CHECK(rc == 0, "KV write: a slot is outside the pool of ", k_cache.size(0) * k_cache.size(1), " slots");
    at::Tensor out = at::empty({T, q.size(1), v_cache.size(3)}, q.options());
    rc = devin_paged_decode_attention(q.data_ptr(), q.stride(0), q.stride(1), rows.data_ptr<int64_t>(),
                                      k_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                                      v_cache.data_ptr(), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
                                      tables.data_ptr<int32_t>(), tables.stride(0), lens.data_ptr<int32_t>(),
                                      out.data_ptr(), out.stride(0), out.stride(1), nullptr, 0, 0, (int)n, (int)hkv,
                                      (int)(q.size(1) / hkv), (int)q.size(2), (int)v_cache.size(3),
                                      (int)k_cache.size(1), (float)scale, code, at::get_num_threads(), (int)chunk);
    TORCH_CHECK(rc == 0, "the C decode-attention kernel rejected its arguments (code ", rc, ")");
    return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(devin, m) {
    m.def("cpu_decode_layer(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, "
          "Tensor rows, Tensor tables, Tensor lens, float scale, int chunk) -> Tensor");
}

TORCH_LIBRARY_IMPL(devin, CPU, m) { m.impl("cpu_decode_layer", TORCH_FN(cpu_decode_layer)); }
