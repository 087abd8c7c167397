// The fused float32 CPU kernels (cpu_kernels.c) as torch operators: TORCH_LIBRARY defines the schemas of
// namespace rlflow, TORCH_LIBRARY_IMPL the CPU implementations. Their fake (meta) implementations and
// autograd formulas are registered from Python (rlflow/ops/backends/cpu.py), which builds and loads this
// file with torch.utils.cpp_extension. Callers check dtypes and shapes before calling (float32, widths a
// multiple of 8, ...); the checks here only keep a wrong call from reading out of bounds.
#include <atomic>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include "cpu_kernels.c"

namespace {

using at::Tensor;

// Calls per C kernel, for tests that check which kernels ran (also inside a compiled graph).
enum Kernel { SWIGLU_FWD, SWIGLU_BWD, RMSNORM_FWD, RMSNORM_BWD, QK_NORM_ROPE_FWD, QK_NORM_ROPE_BWD, PREFIX_ATTN_FWD,
              PREFIX_ATTN_BWD, MOE_SMALL_FWD, MOE_PLAN, GATHER_SUM, ROUTER_FWD, ROUTER_BWD, COUNTER_NOISE, N_KERNELS };
std::atomic<int64_t> calls[N_KERNELS];
inline void count(Kernel k) { calls[k].fetch_add(1, std::memory_order_relaxed); }

inline const float* f32(const Tensor& t) { return t.const_data_ptr<float>(); }
inline float* f32m(Tensor& t) { return t.mutable_data_ptr<float>(); }
inline void need_f32(const Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.device().is_cpu(), "rlflow CPU kernels: ", name, " must be float32 on a CPU");
}
inline int64_t threads() { return std::max<int64_t>(1, at::get_num_threads()); }

Tensor op_swiglu_weighted(const Tensor& gu_, const Tensor& w_) {
  need_f32(gu_, "gu"); need_f32(w_, "w");
  Tensor gu = gu_.contiguous(), w = w_.contiguous();
  TORCH_CHECK(gu.dim() == 2 && gu.size(1) % (2 * W) == 0 && w.dim() == 1 && w.size(0) == gu.size(0), "swiglu_weighted: shapes");
  const int64_t n = gu.size(0), f = gu.size(1) / 2;
  Tensor out = at::empty({n, f}, gu.options());
  count(SWIGLU_FWD);
  swiglu_fwd(f32(gu), f32(w), n, f, f32m(out));
  return out;
}

std::tuple<Tensor, Tensor> op_swiglu_weighted_backward(const Tensor& gu_, const Tensor& w_, const Tensor& dout_) {
  Tensor gu = gu_.contiguous(), w = w_.contiguous(), dout = dout_.contiguous();
  const int64_t n = gu.size(0), f = gu.size(1) / 2;
  TORCH_CHECK(dout.sizes() == at::IntArrayRef({n, f}), "swiglu_weighted_backward: shapes");
  Tensor dgu = at::empty_like(gu), dw = at::empty_like(w);
  count(SWIGLU_BWD);
  swiglu_bwd(f32(gu), f32(w), f32(dout), n, f, f32m(dgu), f32m(dw));
  return {dgu, dw};
}

std::tuple<Tensor, Tensor> op_rmsnorm(const Tensor& x_, const Tensor& w_, double eps) {
  need_f32(x_, "x"); need_f32(w_, "weight");
  Tensor x = x_.contiguous(), w = w_.contiguous();
  TORCH_CHECK(x.dim() >= 1 && w.dim() == 1 && w.size(0) == x.size(-1) && x.size(-1) % W == 0, "rmsnorm: shapes");
  const int64_t d = x.size(-1), n = d ? x.numel() / d : 0;
  Tensor y = at::empty_like(x), rstd = at::empty({n}, x.options());
  count(RMSNORM_FWD);
  rmsnorm_fwd(f32(x), f32(w), n, d, (float)eps, f32m(y), f32m(rstd));
  return {y, rstd};
}

std::tuple<Tensor, Tensor> op_rmsnorm_backward(const Tensor& x_, const Tensor& w_, const Tensor& rstd_, const Tensor& dy_) {
  Tensor x = x_.contiguous(), w = w_.contiguous(), rstd = rstd_.contiguous(), dy = dy_.contiguous();
  const int64_t d = x.size(-1), n = d ? x.numel() / d : 0;
  TORCH_CHECK(dy.sizes() == x.sizes() && rstd.numel() == n, "rmsnorm_backward: shapes");
  const int64_t nt = threads();
  Tensor dx = at::empty_like(x), part = at::zeros({nt, d}, x.options());
  count(RMSNORM_BWD);
  rmsnorm_bwd(f32(x), f32(w), f32(rstd), f32(dy), n, d, (int)nt, f32m(dx), f32m(part));
  return {dx, part.sum(0)};
}

std::tuple<Tensor, Tensor, Tensor> op_qk_norm_rope(const Tensor& qkv_, const std::optional<Tensor>& norm_, const Tensor& cos_,
                                                const Tensor& sin_, int64_t hk, double eps) {
  need_f32(qkv_, "qkv"); need_f32(cos_, "cos"); need_f32(sin_, "sin");
  Tensor qkv = qkv_.contiguous(), cos = cos_.contiguous(), sin = sin_.contiguous();
  Tensor norm = norm_.has_value() ? norm_->contiguous() : Tensor();
  TORCH_CHECK(qkv.dim() >= 3, "qk_norm_rope: qkv [..., T, heads, d]");
  const int64_t heads = qkv.size(-2), d = qkv.size(-1), hv = heads - hk, n = qkv.numel() / std::max<int64_t>(1, heads * d);
  TORCH_CHECK(hk >= 0 && hv >= 0 && d % (2 * W) == 0 && d <= W * 64 && cos.numel() == n * d && sin.numel() == n * d,
              "qk_norm_rope: shapes");
  if (norm.defined()) { need_f32(norm, "norm"); TORCH_CHECK(norm.numel() == hk * d, "qk_norm_rope: norm [hk, d]"); }
  auto qk_size = qkv.sizes().vec(), v_size = qkv.sizes().vec();
  qk_size[qk_size.size() - 2] = hk;
  v_size[v_size.size() - 2] = hv;
  Tensor qk = at::empty(qk_size, qkv.options()), v = at::empty(v_size, qkv.options());
  Tensor rstd = at::empty({norm.defined() ? n : 0, norm.defined() ? hk : 0}, qkv.options());
  count(QK_NORM_ROPE_FWD);
  qk_norm_rope_fwd(f32(qkv), norm.defined() ? f32(norm) : nullptr, f32(cos), f32(sin), n, hk, hv, d, (float)eps, f32m(qk),
                   f32m(v), norm.defined() ? f32m(rstd) : nullptr);
  return {qk, v, rstd};
}

std::tuple<Tensor, Tensor> op_qk_norm_rope_backward(const Tensor& qkv_, const std::optional<Tensor>& norm_, const Tensor& cos_,
                                                 const Tensor& sin_, const Tensor& rstd_, const Tensor& dqk_,
                                                 const Tensor& dv_, int64_t hk) {
  Tensor qkv = qkv_.contiguous(), cos = cos_.contiguous(), sin = sin_.contiguous(), rstd = rstd_.contiguous();
  Tensor dqk = dqk_.contiguous(), dv = dv_.contiguous();
  Tensor norm = norm_.has_value() ? norm_->contiguous() : Tensor();
  const int64_t heads = qkv.size(-2), d = qkv.size(-1), hv = heads - hk, n = qkv.numel() / std::max<int64_t>(1, heads * d);
  TORCH_CHECK(dqk.numel() == n * hk * d && dv.numel() == n * hv * d && (!norm.defined() || rstd.numel() == n * hk),
              "qk_norm_rope_backward: shapes");
  const int64_t nt = threads();
  Tensor dqkv = at::empty_like(qkv);
  Tensor part = norm.defined() ? at::zeros({nt, hk, d}, qkv.options()) : Tensor();
  count(QK_NORM_ROPE_BWD);
  qk_norm_rope_bwd(f32(qkv), norm.defined() ? f32(norm) : nullptr, f32(cos), f32(sin), norm.defined() ? f32(rstd) : nullptr,
                   f32(dqk), f32(dv), n, hk, hv, d, (int)nt, f32m(dqkv), norm.defined() ? f32m(part) : nullptr);
  return {dqkv, norm.defined() ? part.sum(0) : at::empty({0}, qkv.options())};
}

void check_plan(const Tensor& qk, const Tensor& v, int64_t n_q, const Tensor& pvalid, const Tensor& rvalid,
                const Tensor& row_start) {
  need_f32(qk, "qk"); need_f32(v, "v");
  TORCH_CHECK(pvalid.scalar_type() == at::kByte && rvalid.scalar_type() == at::kByte && row_start.scalar_type() == at::kLong
              && pvalid.dim() == 2 && rvalid.dim() == 2 && row_start.dim() == 1 && row_start.size(0) == pvalid.size(0) + 1,
              "prefix_attention: plan (uint8 [P, Tp], uint8 [B, R], int64 [P + 1])");
  TORCH_CHECK(qk.dim() == 3 && v.dim() == 3, "prefix_attention: qk [N, n_q + K, d], v [N, K, d]");
  const int64_t N = qk.size(0), K = qk.size(1) - n_q, d = qk.size(2);
  TORCH_CHECK(K >= 1 && n_q % K == 0 && d % W == 0 && v.size(0) == N && v.size(1) == K && v.size(2) == d
              && N == pvalid.numel() + rvalid.numel(), "prefix_attention: shapes");
  const int64_t* rs = row_start.const_data_ptr<int64_t>();
  TORCH_CHECK(rs[0] == 0 && rs[pvalid.size(0)] == rvalid.size(0), "prefix_attention: row_start");
  for (int64_t p = 0; p < pvalid.size(0); p++) TORCH_CHECK(rs[p + 1] >= rs[p], "prefix_attention: row_start");
}

std::tuple<Tensor, Tensor> op_prefix_attention(const Tensor& qk_, const Tensor& v_, int64_t n_q, const Tensor& pvalid_,
                                            const Tensor& rvalid_, const Tensor& row_start_) {
  Tensor qk = qk_.contiguous(), v = v_.contiguous(), pvalid = pvalid_.contiguous(), rvalid = rvalid_.contiguous();
  Tensor row_start = row_start_.contiguous();
  check_plan(qk, v, n_q, pvalid, rvalid, row_start);
  const int64_t N = qk.size(0), d = qk.size(2);
  Tensor o = at::empty({N, n_q, d}, qk.options()), lse = at::empty({N, n_q}, qk.options());
  count(PREFIX_ATTN_FWD);
  prefix_attn_fwd(f32(qk), f32(v), pvalid.const_data_ptr<uint8_t>(), rvalid.const_data_ptr<uint8_t>(),
                  row_start.const_data_ptr<int64_t>(), pvalid.size(0), pvalid.size(1), rvalid.size(1), n_q,
                  qk.size(1) - n_q, d, f32m(o), f32m(lse));
  return {o, lse};
}

std::tuple<Tensor, Tensor> op_prefix_attention_backward(const Tensor& qk_, const Tensor& v_, int64_t n_q, const Tensor& pvalid_,
                                                     const Tensor& rvalid_, const Tensor& row_start_, const Tensor& o_,
                                                     const Tensor& lse_, const Tensor& do_) {
  Tensor qk = qk_.contiguous(), v = v_.contiguous(), pvalid = pvalid_.contiguous(), rvalid = rvalid_.contiguous();
  Tensor row_start = row_start_.contiguous(), o = o_.contiguous(), lse = lse_.contiguous(), dout = do_.contiguous();
  check_plan(qk, v, n_q, pvalid, rvalid, row_start);
  TORCH_CHECK(dout.sizes() == o.sizes() && o.size(0) == qk.size(0) && o.size(1) == n_q && lse.numel() == o.numel() / o.size(2),
              "prefix_attention_backward: shapes");
  Tensor dqk = at::empty_like(qk), dv = at::empty_like(v);
  count(PREFIX_ATTN_BWD);
  prefix_attn_bwd(f32(qk), f32(v), pvalid.const_data_ptr<uint8_t>(), rvalid.const_data_ptr<uint8_t>(),
                  row_start.const_data_ptr<int64_t>(), pvalid.size(0), pvalid.size(1), rvalid.size(1), n_q,
                  qk.size(1) - n_q, qk.size(2), f32(o), f32(lse), f32(dout), f32m(dqk), f32m(dv));
  return {dqk, dv};
}

void check_ids(const Tensor& idx, int64_t E, const char* op) {
  const int64_t* p = idx.const_data_ptr<int64_t>();
  int64_t lo = 0, hi = 0;
  bool bad = false;
  for (int64_t i = 0; i < idx.numel(); i++) {
    lo = i ? std::min(lo, p[i]) : p[i];
    hi = i ? std::max(hi, p[i]) : p[i];
    bad |= p[i] < 0 || p[i] >= E;
  }
  TORCH_CHECK_VALUE(!bad, op, ": expert ids must be in [0, ", E, "), got ", lo, "..", hi);
}

Tensor op_moe_small_experts(const Tensor& x_, const Tensor& w_, const Tensor& idx_, const Tensor& gu_, const Tensor& dn_) {
  need_f32(x_, "x"); need_f32(w_, "w"); need_f32(gu_, "gate_up_t"); need_f32(dn_, "down_t");
  Tensor x = x_.contiguous(), w = w_.contiguous(), idx = idx_.contiguous(), gu = gu_.contiguous(), dn = dn_.contiguous();
  TORCH_CHECK(idx.scalar_type() == at::kLong && idx.dim() == 2 && w.sizes() == idx.sizes() && x.dim() == 2
              && x.size(0) == idx.size(0) && gu.dim() == 3 && dn.dim() == 3, "moe_small_experts: shapes");
  const int64_t N = idx.size(0), K = idx.size(1), E = gu.size(0), D = gu.size(1), F2 = gu.size(2);
  TORCH_CHECK(x.size(1) == D && D % (2 * W) == 0 && F2 % (4 * W) == 0 && dn.size(0) == E && dn.size(1) == F2 / 2
              && dn.size(2) == D, "moe_small_experts: shapes");
  check_ids(idx, E, "moe_small_experts");
  Tensor out = at::empty_like(x);
  count(MOE_SMALL_FWD);
  moe_small_fwd(f32(x), idx.const_data_ptr<int64_t>(), f32(w), f32(gu), f32(dn), N, K, E, D, F2 / 2, f32m(out));
  return out;
}

std::tuple<Tensor, Tensor, Tensor> op_route(const Tensor& logits_, int64_t k, bool norm) {
  need_f32(logits_, "logits");
  Tensor logits = logits_.contiguous();
  TORCH_CHECK(logits.dim() == 2 && k >= 1 && k <= logits.size(1), "route: logits [N, E], 1 <= k <= E");
  const int64_t n = logits.size(0), E = logits.size(1);
  Tensor w = at::empty({n, k}, logits.options()), idx = at::empty({n, k}, logits.options().dtype(at::kLong));
  Tensor probs = at::empty_like(logits);
  count(ROUTER_FWD);
  router_fwd(f32(logits), n, E, k, norm, f32m(w), idx.mutable_data_ptr<int64_t>(), f32m(probs));
  return {w, idx, probs};
}

Tensor op_route_backward(const Tensor& probs_, const Tensor& idx_, const Tensor& w_, const Tensor& dw_, bool norm) {
  Tensor probs = probs_.contiguous(), idx = idx_.contiguous(), w = w_.contiguous(), dw = dw_.contiguous();
  TORCH_CHECK(idx.sizes() == w.sizes() && dw.sizes() == w.sizes() && probs.dim() == 2 && idx.size(0) == probs.size(0),
              "route_backward: shapes");
  check_ids(idx, probs.size(1), "route_backward");
  Tensor dl = at::empty_like(probs);
  count(ROUTER_BWD);
  router_bwd(f32(probs), idx.const_data_ptr<int64_t>(), f32(w), f32(dw), probs.size(0), probs.size(1), idx.size(1), norm,
             f32m(dl));
  return dl;
}

std::tuple<Tensor, Tensor, Tensor, Tensor> op_moe_plan(const Tensor& idx_, int64_t E) {
  TORCH_CHECK(idx_.scalar_type() == at::kLong && idx_.dim() == 2 && idx_.device().is_cpu(), "moe_plan: int64 [N, K] on a CPU");
  Tensor idx = idx_.contiguous();
  check_ids(idx, E, "moe_plan");
  const int64_t M = idx.numel();
  auto i64 = idx.options();
  Tensor order = at::empty({M}, i64), tok = at::empty({M}, i64), inv = at::empty({M}, i64);
  Tensor offs = at::empty({E}, i64.dtype(at::kInt));
  count(MOE_PLAN);
  ::moe_plan(idx.const_data_ptr<int64_t>(), idx.size(0), idx.size(1), E, order.mutable_data_ptr<int64_t>(),
           tok.mutable_data_ptr<int64_t>(), inv.mutable_data_ptr<int64_t>(), offs.mutable_data_ptr<int32_t>());
  return {order, tok, inv, offs};
}

// x[tok]: the rows of x in the plan's sorted order (its adjoint is combine_rows)
Tensor op_gather_rows(const Tensor& x, const Tensor& tok, const Tensor& inv, int64_t k) {
  return at::index_select(x, 0, tok);
}

// out[n] = the sum of the k rows of ys (sorted by expert) that token n was routed to (its adjoint is gather_rows)
Tensor op_combine_rows(const Tensor& ys_, const Tensor& tok, const Tensor& inv_, int64_t k) {
  need_f32(ys_, "ys");
  Tensor ys = ys_.contiguous(), inv = inv_.contiguous();
  TORCH_CHECK(ys.dim() == 2 && ys.size(1) % W == 0 && k >= 1 && inv.numel() == ys.size(0) && inv.numel() % k == 0
              && inv.scalar_type() == at::kLong, "combine_rows: shapes");
  const int64_t* p = inv.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < inv.numel(); i++) TORCH_CHECK(p[i] >= 0 && p[i] < ys.size(0), "combine_rows: inv out of range");
  Tensor out = at::empty({inv.numel() / k, ys.size(1)}, ys.options());
  count(GATHER_SUM);
  gather_sum(f32(ys), p, out.size(0), k, ys.size(1), f32m(out));
  return out;
}

Tensor op_counter_noise(const Tensor& keys_, const Tensor& pos_, int64_t vocab) {
  TORCH_CHECK(keys_.scalar_type() == at::kLong && pos_.scalar_type() == at::kLong && keys_.device().is_cpu() &&
              keys_.dim() == 1 && pos_.sizes() == keys_.sizes() && vocab >= 0, "counter_noise: keys, pos int64 [B] on a CPU");
  Tensor keys = keys_.contiguous(), pos = pos_.contiguous();
  Tensor out = at::empty({keys.size(0), vocab}, keys.options().dtype(at::kFloat));
  count(COUNTER_NOISE);
  counter_noise_fwd(keys.const_data_ptr<int64_t>(), pos.const_data_ptr<int64_t>(), keys.size(0), vocab, f32m(out));
  return out;
}

std::vector<int64_t> kernel_calls() {
  std::vector<int64_t> out(N_KERNELS);
  for (int i = 0; i < N_KERNELS; i++) out[i] = calls[i].load(std::memory_order_relaxed);
  return out;
}
int64_t kernels_openmp() { return rlflow_kernels_openmp(); }
int64_t kernels_max_threads() { return rlflow_kernels_max_threads(); }

}  // namespace

TORCH_LIBRARY(rlflow, m) {
  m.def("swiglu_weighted(Tensor gu, Tensor w) -> Tensor");
  m.def("swiglu_weighted_backward(Tensor gu, Tensor w, Tensor dout) -> (Tensor, Tensor)");
  m.def("rmsnorm(Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rmsnorm_backward(Tensor x, Tensor weight, Tensor rstd, Tensor dy) -> (Tensor, Tensor)");
  m.def("qk_norm_rope(Tensor qkv, Tensor? norm, Tensor cos, Tensor sin, int hk, float eps) -> (Tensor, Tensor, Tensor)");
  m.def("qk_norm_rope_backward(Tensor qkv, Tensor? norm, Tensor cos, Tensor sin, Tensor rstd, Tensor dqk, Tensor dv, "
        "int hk) -> (Tensor, Tensor)");
  m.def("prefix_attention(Tensor qk, Tensor v, int n_q, Tensor pvalid, Tensor rvalid, Tensor row_start) -> (Tensor, Tensor)");
  m.def("prefix_attention_backward(Tensor qk, Tensor v, int n_q, Tensor pvalid, Tensor rvalid, Tensor row_start, "
        "Tensor o, Tensor lse, Tensor dout) -> (Tensor, Tensor)");
  m.def("moe_small_experts(Tensor x, Tensor w, Tensor idx, Tensor gate_up_t, Tensor down_t) -> Tensor");
  m.def("route(Tensor logits, int k, bool norm) -> (Tensor, Tensor, Tensor)");
  m.def("route_backward(Tensor probs, Tensor idx, Tensor w, Tensor dw, bool norm) -> Tensor");
  m.def("moe_plan(Tensor idx, int n_experts) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("gather_rows(Tensor x, Tensor tok, Tensor inv, int k) -> Tensor");
  m.def("combine_rows(Tensor ys, Tensor tok, Tensor inv, int k) -> Tensor");
  m.def("counter_noise(Tensor keys, Tensor pos, int vocab) -> Tensor");
  m.def("_kernel_calls() -> int[]", &kernel_calls);
  m.def("_kernels_openmp() -> int", &kernels_openmp);
  m.def("_kernels_max_threads() -> int", &kernels_max_threads);
}

TORCH_LIBRARY_IMPL(rlflow, CPU, m) {
  m.impl("swiglu_weighted", &op_swiglu_weighted);
  m.impl("swiglu_weighted_backward", &op_swiglu_weighted_backward);
  m.impl("rmsnorm", &op_rmsnorm);
  m.impl("rmsnorm_backward", &op_rmsnorm_backward);
  m.impl("qk_norm_rope", &op_qk_norm_rope);
  m.impl("qk_norm_rope_backward", &op_qk_norm_rope_backward);
  m.impl("prefix_attention", &op_prefix_attention);
  m.impl("prefix_attention_backward", &op_prefix_attention_backward);
  m.impl("moe_small_experts", &op_moe_small_experts);
  m.impl("route", &op_route);
  m.impl("counter_noise", &op_counter_noise);
  m.impl("route_backward", &op_route_backward);
  m.impl("moe_plan", &op_moe_plan);
  m.impl("gather_rows", &op_gather_rows);
  m.impl("combine_rows", &op_combine_rows);
}
