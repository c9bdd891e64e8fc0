// The CPU kernel of devin::moe_experts (float32): HF's routed experts in one call.
//
// Built and loaded by backends/fused/cpu_moe_experts_op.py, linked with cpu_packed_gemm.c. Steps:
//   1. counting sort of the (token, slot) pairs by expert (stable: pair order within an expert);
//      ids outside [0, E) select no expert and contribute 0 (HF's histc drops them the same way);
//   2. devin_moe_gate_up: each selected expert's gate/up weights read once, for all its rows;
//   3. at::silu(gate) * up: the same aten kernels as HF's act_fn(gate) * up, bit for bit;
//   4. devin_moe_down: each selected expert's down weights read once; rows scaled by their
//      routing weight and written at their pair's place [T·k, H];
//   5. at::sum over the k slots, as HF's view(T, k, H).sum(1).
// Calls outside these preconditions (another dtype, non-contiguous rows, a packing it does not
// know) are redispatched to the op's Python kernel (CompositeExplicitAutograd), which computes
// every case with torch ops.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/zeros.h>
#include <c10/core/DispatchKeySet.h>
#include <torch/library.h>

#include <vector>

extern "C" {
int devin_moe_gate_up(const float *x, int64_t x_stride, const int64_t *tok, const int64_t *offs, int e,
                      const float *w, int h, int f, float *buf, int num_threads);
int devin_moe_down(const float *hbuf, const int64_t *pair, const float *pair_w, const int64_t *offs, int e,
                   const float *w, int h, int f, float *y, int num_threads);
}

namespace {

using Signature = at::Tensor(const at::Tensor &, const at::Tensor &, const at::Tensor &, const at::Tensor &,
                             const at::Tensor &);

bool fits(const at::Tensor &x, const at::Tensor &ids, const at::Tensor &weights, const at::Tensor &gate_up,
          const at::Tensor &down) {
    const auto f32 = c10::ScalarType::Float;
    if (x.scalar_type() != f32 || x.dim() != 2 || x.stride(1) != 1 || ids.scalar_type() != c10::ScalarType::Long ||
        ids.dim() != 2 || ids.size(0) != x.size(0) || weights.scalar_type() != f32 || weights.sizes() != ids.sizes())
        return false;
    if (gate_up.scalar_type() != f32 || gate_up.dim() != 4 || !gate_up.is_contiguous() || gate_up.size(3) != 32 ||
        gate_up.size(2) != x.size(1))
        return false;
    return down.scalar_type() == f32 && down.dim() == 4 && down.is_contiguous() && down.size(3) == 16 &&
           down.size(0) == gate_up.size(0) && down.size(1) * 16 == x.size(1) && down.size(2) == gate_up.size(1) * 16;
}

at::Tensor moe_experts_cpu(const at::Tensor &x, const at::Tensor &ids, const at::Tensor &weights,
                           const at::Tensor &gate_up, const at::Tensor &down) {
    if (!fits(x, ids, weights, gate_up, down)) {
        static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("devin::moe_experts", "").typed<Signature>();
        return op.redispatch(c10::DispatchKeySet(c10::DispatchKey::CompositeExplicitAutograd), x, ids, weights,
                             gate_up, down);
    }
    const int64_t t = x.size(0), k = ids.size(1), h = x.size(1), pairs = t * k;
    const int64_t e = gate_up.size(0), f = gate_up.size(1) * 16;
    const at::Tensor ids_c = ids.contiguous(), w_c = weights.contiguous();
    const int64_t *id = ids_c.data_ptr<int64_t>();

    std::vector<int64_t> offs(e + 1, 0), pair(pairs), tok(pairs);
    for (int64_t q = 0; q < pairs; q++)
        if (id[q] >= 0 && id[q] < e) offs[id[q] + 1]++;
    for (int64_t i = 0; i < e; i++) offs[i + 1] += offs[i];
    const int64_t routed = offs[e];
    std::vector<int64_t> next(offs.begin(), offs.end() - 1);
    for (int64_t q = 0; q < pairs; q++) {
        if (id[q] < 0 || id[q] >= e) continue;
        const int64_t p = next[id[q]]++;
        pair[p] = q;
        tok[p] = q / k;
    }

    at::Tensor y = routed == pairs ? at::empty({pairs, h}, x.options()) : at::zeros({pairs, h}, x.options());
    if (routed > 0) {
        const int threads = at::get_num_threads();
        at::Tensor buf = at::empty({routed, 2 * f}, x.options());
        int rc = devin_moe_gate_up(x.data_ptr<float>(), x.stride(0), tok.data(), offs.data(), (int)e,
                                   gate_up.data_ptr<float>(), (int)h, (int)f, buf.data_ptr<float>(), threads);
        TORCH_CHECK(rc == 0, "devin::moe_experts: the gate/up kernel rejected H=", h, ", F=", f);
        at::Tensor act = at::silu(buf.narrow(1, 0, f));
        act.mul_(buf.narrow(1, f, f));
        rc = devin_moe_down(act.data_ptr<float>(), pair.data(), w_c.data_ptr<float>(), offs.data(), (int)e,
                            down.data_ptr<float>(), (int)h, (int)f, y.data_ptr<float>(), threads);
        TORCH_CHECK(rc == 0, "devin::moe_experts: the down kernel rejected H=", h, ", F=", f);
    }
    return y.view({t, k, h}).sum(1);
}

}  // namespace

TORCH_LIBRARY_IMPL(devin, CPU, m) { m.impl("moe_experts", TORCH_FN(moe_experts_cpu)); }
