/* Fused float32 CPU kernels for the training forward/backward (rlflow/ops/cpu_kernels.py builds and
 * loads this file; the torch ops in rlflow/ops are the reference each kernel is tested against).
 *
 * Why: on a CPU the update's activations (MBs per op) stream through DRAM, and each unfused elementwise
 * op is one more pass over them; these kernels do in one pass what took 3-10 torch ops. Row-parallel
 * with OpenMP (torch's own runtime, see cpu_kernels.py), vectorized with GCC/Clang vector extensions
 * (8 floats; widths must be multiples of 8, checked by the caller). Rows are independent; reductions over
 * rows (weight gradients) go to one partial row per thread, summed by the caller.
 */
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

typedef float vf __attribute__((vector_size(32)));
typedef int32_t vi __attribute__((vector_size(32)));
#define W 8
#define BLOCK 64 /* rows per block of a weight-gradient sum */

static inline vf vld(const float* p) { vf v; __builtin_memcpy(&v, p, sizeof v); return v; }
static inline void vst(float* p, vf v) { __builtin_memcpy(p, &v, sizeof v); }
static inline vf vsplat(float x) { return (vf){x, x, x, x, x, x, x, x}; }
static inline vf vsel(vi m, vf a, vf b) { return (vf)((m & (vi)a) | (~m & (vi)b)); }
static inline float vsum(vf v) { float s = 0.f; for (int i = 0; i < W; i++) s += v[i]; return s; }

/* exp(x), Cephes' single-precision polynomial (relative error ~1e-7); x clamped to [-87, 88]. */
static inline vf vexp(vf x) {
  x = vsel(x < vsplat(-87.0f), vsplat(-87.0f), x);
  x = vsel(x > vsplat(88.0f), vsplat(88.0f), x);
  vf t = x * vsplat(1.44269504088896341f) + vsplat(0.5f);
  vi k = __builtin_convertvector(t, vi);           /* truncation ... */
  k = k + (__builtin_convertvector(k, vf) > t);   /* ... to floor (a true compare is -1) */
  vf kf = __builtin_convertvector(k, vf);
  vf r = x - kf * vsplat(0.693359375f) + kf * vsplat(2.12194440e-4f);
  vf y = vsplat(1.9875691500E-4f);
  y = y * r + vsplat(1.3981999507E-3f);
  y = y * r + vsplat(8.3334519073E-3f);
  y = y * r + vsplat(4.1665795894E-2f);
  y = y * r + vsplat(1.6666665459E-1f);
  y = y * r + vsplat(5.0000001201E-1f);
  y = y * r * r + r + vsplat(1.0f);
  return y * (vf)((k + 127) << 23);
}
static inline vf vsigmoid(vf x) { return vsplat(1.0f) / (vsplat(1.0f) + vexp(-x)); }

/* The rows [lo, hi) of n that thread `tid` of `nt` takes. */
static inline void span(int64_t n, int nt, int tid, int64_t* lo, int64_t* hi) {
  *lo = n * tid / nt;
  *hi = n * (tid + 1) / nt;
}
#ifdef _OPENMP
#define THREAD_ID omp_get_thread_num()
#else
#define THREAD_ID 0
#endif

int rlflow_kernels_openmp(void) {
#ifdef _OPENMP
  return 1;
#else
  return 0;
#endif
}

/* ---- SwiGLU with a per-row weight: out[r] = silu(g[r]) * u[r] * w[r], gu[r] = [g | u] (2f floats) ---- */

void swiglu_fwd(const float* gu, const float* w, int64_t n, int64_t f, float* out) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < n; r++) {
    const float* g = gu + r * 2 * f;
    const float* u = g + f;
    const vf wr = vsplat(w[r]);
    for (int64_t j = 0; j < f; j += W) {
      vf gv = vld(g + j);
      vst(out + r * f + j, gv * vsigmoid(gv) * vld(u + j) * wr);
    }
  }
}

/* d/dg = dout w u s (1 + g (1 - s)), d/du = dout w silu(g), d/dw = sum_j dout silu(g) u (s = sigmoid(g)). */
void swiglu_bwd(const float* gu, const float* w, const float* dout, int64_t n, int64_t f, float* dgu, float* dw) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < n; r++) {
    const float* g = gu + r * 2 * f;
    const float* u = g + f;
    const float* d = dout + r * f;
    float* dg = dgu + r * 2 * f;
    float* du = dg + f;
    const vf wr = vsplat(w[r]);
    vf acc = vsplat(0.0f);
    for (int64_t j = 0; j < f; j += W) {
      vf gv = vld(g + j), uv = vld(u + j), dv = vld(d + j);
      vf s = vsigmoid(gv), silu = gv * s, dw_ = dv * wr;
      acc += dv * silu * uv;
      vst(dg + j, dw_ * uv * s * (vsplat(1.0f) + gv * (vsplat(1.0f) - s)));
      vst(du + j, dw_ * silu);
    }
    dw[r] = vsum(acc);
  }
}

/* ---- RMSNorm over rows of d: y = w * x / sqrt(mean(x^2) + eps); rstd[r] kept for the backward ---- */

static inline float row_rstd(const float* x, int64_t d, float eps) {
  vf acc = vsplat(0.0f);
  for (int64_t j = 0; j < d; j += W) {
    vf xv = vld(x + j);
    acc += xv * xv;
  }
  return 1.0f / __builtin_sqrtf(vsum(acc) / (float)d + eps);
}

void rmsnorm_fwd(const float* x, const float* w, int64_t n, int64_t d, float eps, float* y, float* rstd) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < n; r++) {
    const float* xr = x + r * d;
    float rs = row_rstd(xr, d, eps);
    rstd[r] = rs;
    for (int64_t j = 0; j < d; j += W) vst(y + r * d + j, vld(w + j) * (vld(xr + j) * vsplat(rs)));
  }
}

/* dx = rstd (dy w - xhat mean(dy w xhat)), xhat = x rstd; dw = sum_rows dy xhat, into part[thread][d]. */
void rmsnorm_bwd(const float* x, const float* w, const float* rstd, const float* dy, int64_t n, int64_t d,
                 int nt, float* dx, float* part) {
#pragma omp parallel num_threads(nt)
  {
    int64_t lo, hi;
    span(n, nt, THREAD_ID, &lo, &hi);
    float* pw = part + (int64_t)THREAD_ID * d;
    float blk[d];  /* dw over a block of rows, then added to the thread's partial: error ~ (BLOCK + n/BLOCK) eps */
    for (int64_t b0 = lo; b0 < hi; b0 += BLOCK) {
      for (int64_t j = 0; j < d; j += W) vst(blk + j, vsplat(0.0f));
      for (int64_t r = b0; r < b0 + BLOCK && r < hi; r++) {
        const float* xr = x + r * d;
        const float* dr = dy + r * d;
        const vf rs = vsplat(rstd[r]);
        vf acc = vsplat(0.0f);
        for (int64_t j = 0; j < d; j += W) {
          vf xh = vld(xr + j) * rs, dv = vld(dr + j);
          acc += dv * vld(w + j) * xh;
          vst(blk + j, vld(blk + j) + dv * xh);
        }
        const vf m = vsplat(vsum(acc) / (float)d);
        for (int64_t j = 0; j < d; j += W) {
          vf xh = vld(xr + j) * rs;
          vst(dx + r * d + j, rs * (vld(dr + j) * vld(w + j) - xh * m));
        }
      }
      for (int64_t j = 0; j < d; j += W) vst(pw + j, vld(pw + j) + vld(blk + j));
    }
  }
}

/* ---- Per-head RMSNorm (optional) and rotary embedding of q/k, and v copied out, from the fused qkv ----
 * qkv: rows of (hk + hv) heads of d (q and k heads first: hk = H + K; then hv = K value heads).
 * Per head h < hk: y = x rstd * normw[h] (normw NULL: y = x, no norm), out = y cos + roll(y, d/2) sin, with
 * cos/sin rows of d per token (rotate-half's sign folded into sin). qk_out [n, hk, d], v_out [n, hv, d],
 * rstd [n, hk] (unused without a norm). */

static inline void rope_row(const float* y, const float* c, const float* s, int64_t d, float* out) {
  const int64_t h = d / 2;
  for (int64_t j = 0; j < h; j += W) {
    vf y1 = vld(y + j), y2 = vld(y + h + j);
    vst(out + j, y1 * vld(c + j) + y2 * vld(s + j));
    vst(out + h + j, y2 * vld(c + h + j) + y1 * vld(s + h + j));
  }
}

void qk_norm_rope_fwd(const float* qkv, const float* normw, const float* cos, const float* sin, int64_t n,
                      int64_t hk, int64_t hv, int64_t d, float eps, float* qk_out, float* v_out, float* rstd) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < n; r++) {
    const float* row = qkv + r * (hk + hv) * d;
    const float* c = cos + r * d;
    const float* s = sin + r * d;
    float y[d];
    for (int64_t h = 0; h < hk; h++) {
      const float* x = row + h * d;
      const float* src = x;
      if (normw) {
        float rs = row_rstd(x, d, eps);
        rstd[r * hk + h] = rs;
        for (int64_t j = 0; j < d; j += W) vst(y + j, vld(normw + h * d + j) * (vld(x + j) * vsplat(rs)));
        src = y;
      }
      rope_row(src, c, s, d, qk_out + (r * hk + h) * d);
    }
    for (int64_t j = 0; j < hv * d; j += W) vst(v_out + r * hv * d + j, vld(row + hk * d + j));
  }
}

/* The adjoint: dy = dout cos + roll(dout sin, d/2) (roll by half a row is its own inverse), then the norm's
 * backward (as rmsnorm_bwd, per head, dnormw into part[thread][hk][d]); dv copied into its columns. */
void qk_norm_rope_bwd(const float* qkv, const float* normw, const float* cos, const float* sin, const float* rstd,
                      const float* dqk, const float* dv, int64_t n, int64_t hk, int64_t hv, int64_t d, int nt,
                      float* dqkv, float* part) {
#pragma omp parallel num_threads(nt)
  {
    int64_t lo, hi;
    span(n, nt, THREAD_ID, &lo, &hi);
    float* pw = part + (int64_t)THREAD_ID * hk * d;
    const int64_t half = d / 2;
    float dy[d];
    float blk[normw ? hk * d : 1];  /* dnormw over a block of rows (see rmsnorm_bwd) */
    for (int64_t r = lo; r < hi; r++) {
      if (normw && (r - lo) % BLOCK == 0) {
        if (r > lo)
          for (int64_t j = 0; j < hk * d; j += W) vst(pw + j, vld(pw + j) + vld(blk + j));
        for (int64_t j = 0; j < hk * d; j += W) vst(blk + j, vsplat(0.0f));
      }
      const float* row = qkv + r * (hk + hv) * d;
      const float* c = cos + r * d;
      const float* s = sin + r * d;
      float* drow = dqkv + r * (hk + hv) * d;
      for (int64_t h = 0; h < hk; h++) {
        const float* g = dqk + (r * hk + h) * d;
        for (int64_t j = 0; j < half; j += W) {
          vf g1 = vld(g + j), g2 = vld(g + half + j);
          vst(dy + j, g1 * vld(c + j) + g2 * vld(s + half + j));
          vst(dy + half + j, g2 * vld(c + half + j) + g1 * vld(s + j));
        }
        float* dx = drow + h * d;
        if (!normw) {
          for (int64_t j = 0; j < d; j += W) vst(dx + j, vld(dy + j));
          continue;
        }
        const float* x = row + h * d;
        const float* wh = normw + h * d;
        const vf rs = vsplat(rstd[r * hk + h]);
        vf acc = vsplat(0.0f);
        for (int64_t j = 0; j < d; j += W) {
          vf xh = vld(x + j) * rs, dyv = vld(dy + j);
          acc += dyv * vld(wh + j) * xh;
          vst(blk + h * d + j, vld(blk + h * d + j) + dyv * xh);
        }
        const vf m = vsplat(vsum(acc) / (float)d);
        for (int64_t j = 0; j < d; j += W) {
          vf xh = vld(x + j) * rs;
          vst(dx + j, rs * (vld(dy + j) * vld(wh + j) - xh * m));
        }
      }
      for (int64_t j = 0; j < hv * d; j += W) vst(drow + hk * d + j, vld(dv + r * hv * d + j));
    }
    if (normw && hi > lo)
      for (int64_t j = 0; j < hk * d; j += W) vst(pw + j, vld(pw + j) + vld(blk + j));
  }
}
