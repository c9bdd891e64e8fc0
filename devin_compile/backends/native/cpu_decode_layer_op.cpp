// devin::cpu_decode_layer, and the CPU kernel of devin::paged_attention's pure-decode steps: one
// layer of a pure-decode step on CPU in one call: write the step's new K/V rows into the paged
// pool, then attend (cpu_paged_decode.c's two kernels).
//
// - cpu_decode_layer: the cpu_sdpa backend's Python path calls it for each layer of a step in
//   which every sequence has one query (~55 Python-side ctypes arguments and checks per layer
//   before it: ~60 us of a decode step's ~95 us per layer on a 2-core CPU).
// - paged_attention (CPU kernel): skips Python altogether. The runtime pushes the step's rows /
//   block tables / lengths / chunk and the whole KV pool once per step (cpu_decode_step_push,
//   thread-local, a stack so step contexts nest); each layer's call then runs here when a step is
//   pushed and its tensors fit (one dtype, last dims contiguous, no soft-cap, no sliding window,
//   no ALiBi slopes, no attention sinks, no attention chunk),
//   and every other call is redispatched to the op's Python kernel (CompositeExplicitAutograd),
//   which implements all of them with the same result. cpu_decode_step_pop returns how many
//   layers ran here.
// Preconditions of cpu_decode_layer (checked by the caller once per step, re-checked cheaply
// here): one dtype (float32 / bf16 / fp16) for q, k, v and both pools; last dims contiguous;
// slots int64 [T], rows int64 [n], tables int32 [n, M], lens int32 [n].
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/DispatchKeySet.h>
#include <torch/library.h>

#include <optional>
#include <vector>
#include "cpu_torch_op.h"

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

// Why cpu_decode_layer cannot take these tensors, or nullptr when it can.
const char *misfit(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, const at::Tensor &k_cache,
                   const at::Tensor &v_cache, const at::Tensor &slots, const at::Tensor &rows, const at::Tensor &tables,
                   const at::Tensor &lens) {
    const auto t = q.scalar_type();
    if (dtype_code(t) < 0 || k.scalar_type() != t || v.scalar_type() != t || k_cache.scalar_type() != t ||
        v_cache.scalar_type() != t)
        return "q, k, v and the pools need one dtype of float32/bf16/fp16";
    if (q.dim() != 3 || k.dim() != 3 || v.dim() != 3 || k_cache.dim() != 4 || v_cache.dim() != 4 || tables.dim() != 2)
        return "q/k/v [T, H, D] and pools [blocks, block_size, Hkv, D]";
    if (q.stride(2) != 1 || k.stride(2) != 1 || v.stride(2) != 1 || k_cache.stride(3) != 1 || v_cache.stride(3) != 1 ||
        tables.stride(1) != 1)
        return "last dims must be contiguous";
    if (slots.scalar_type() != at::kLong || rows.scalar_type() != at::kLong || tables.scalar_type() != at::kInt ||
        lens.scalar_type() != at::kInt || !slots.is_contiguous() || !rows.is_contiguous() || !lens.is_contiguous())
        return "slots/rows int64, tables/lens int32, contiguous";
    const int64_t T = q.size(0), hkv = k_cache.size(2), n = rows.size(0);
    if (k.size(0) != T || v.size(0) != T || slots.size(0) != T || k.size(1) != hkv || v.size(1) != hkv ||
        k.size(2) != k_cache.size(3) || v.size(2) != v_cache.size(3) || q.size(1) % hkv != 0 || tables.size(0) != n ||
        lens.size(0) != n)
        return "shapes disagree";
    if (q.size(1) / hkv > 32 || q.size(2) > 512 || v.size(2) > 512) return "more than 32 query heads a KV head, or head dims above 512";
    return nullptr;
}

at::Tensor decode_layer(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, const at::Tensor &k_cache,
                        const at::Tensor &v_cache, const at::Tensor &slots, const at::Tensor &rows,
                        const at::Tensor &tables, const at::Tensor &lens, double scale, int64_t chunk) {
    const int64_t T = q.size(0), hkv = k_cache.size(2), n = rows.size(0);
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
                                      (int)k_cache.size(1), (float)scale, dtype_code(q.scalar_type()),
                                      at::get_num_threads(), (int)chunk);
    TORCH_CHECK(rc == 0, "the C decode-attention kernel rejected its arguments (code ", rc, ")");
    return out;
}

at::Tensor cpu_decode_layer(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, at::Tensor &k_cache,
                            at::Tensor &v_cache, const at::Tensor &slots, const at::Tensor &rows,
                            const at::Tensor &tables, const at::Tensor &lens, double scale, int64_t chunk) {
    const char *why = misfit(q, k, v, k_cache, v_cache, slots, rows, tables, lens);
    TORCH_CHECK(why == nullptr, "cpu_decode_layer: ", why);
    return decode_layer(q, k, v, k_cache, v_cache, slots, rows, tables, lens, scale, chunk);
}

// One pushed step: the pool [layers, 2, blocks, block_size, Hkv, D] (undefined: this step is not
// served here) and the step's metadata, as cpu_decode_layer takes it.
struct DecodeStep {
    at::Tensor pool, slots, rows, tables, lens;
    int64_t chunk = 0;
    int64_t served = 0;
};

thread_local std::vector<DecodeStep> steps;

void cpu_decode_step_push(const std::optional<at::Tensor> &pool, const at::Tensor &slots, const at::Tensor &rows,
                          const at::Tensor &tables, const at::Tensor &lens, int64_t chunk) {
    DecodeStep s;
    if (pool.has_value()) {
        TORCH_CHECK(pool->dim() == 6 && pool->size(1) == 2, "cpu_decode_step_push: the pool must be "
                    "[layers, 2, blocks, block_size, Hkv, D]");
        s = DecodeStep{*pool, slots, rows, tables, lens, chunk, 0};
    }
    steps.push_back(std::move(s));
}

int64_t cpu_decode_step_pop() {
    TORCH_CHECK(!steps.empty(), "cpu_decode_step_pop: no step was pushed on this thread");
    const int64_t served = steps.back().served;
    steps.pop_back();
    return served;
}

using AttentionSignature = at::Tensor(const at::Tensor &, const at::Tensor &, const at::Tensor &, int64_t, double,
                                      double, int64_t, const std::optional<at::Tensor> &,
                                      const std::optional<at::Tensor> &, int64_t);

at::Tensor paged_attention_cpu(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, int64_t layer,
                               double scale, double softcap, int64_t sliding_window,
                               const std::optional<at::Tensor> &alibi_slopes, const std::optional<at::Tensor> &sinks,
                               int64_t attention_chunk) {
    // ALiBi, sink and chunked calls go to the Python kernel, which applies the bias, the sinks or the chunk
    if (!steps.empty() && steps.back().pool.defined() && softcap <= 0 && sliding_window <= 0 &&
        !alibi_slopes.has_value() && !sinks.has_value() && attention_chunk <= 0) {
        DecodeStep &s = steps.back();
        if (layer >= 0 && layer < s.pool.size(0)) {
            const at::Tensor layer_pool = s.pool.select(0, layer);
            const at::Tensor k_cache = layer_pool.select(0, 0), v_cache = layer_pool.select(0, 1);
            if (misfit(q, k, v, k_cache, v_cache, s.slots, s.rows, s.tables, s.lens) == nullptr) {
                s.served++;
                return decode_layer(q, k, v, k_cache, v_cache, s.slots, s.rows, s.tables, s.lens, scale, s.chunk);
            }
        }
    }
    static auto op =
        c10::Dispatcher::singleton().findSchemaOrThrow("devin::paged_attention", "").typed<AttentionSignature>();
    return op.redispatch(c10::DispatchKeySet(c10::DispatchKey::CompositeExplicitAutograd), q, k, v, layer, scale,
                         softcap, sliding_window, alibi_slopes, sinks, attention_chunk);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(devin, m) {
    m.def("cpu_decode_layer(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, "
          "Tensor rows, Tensor tables, Tensor lens, float scale, int chunk) -> Tensor");
    m.def("cpu_decode_step_push(Tensor? pool, Tensor slots, Tensor rows, Tensor tables, Tensor lens, int chunk) -> ()",
          TORCH_FN(cpu_decode_step_push));
    m.def("cpu_decode_step_pop() -> int", TORCH_FN(cpu_decode_step_pop));
}

TORCH_LIBRARY_IMPL(devin, CPU, m) {
    m.impl("cpu_decode_layer", TORCH_FN(cpu_decode_layer));
    m.impl("paged_attention", TORCH_FN(paged_attention_cpu));
}
