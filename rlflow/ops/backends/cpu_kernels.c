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
#define THREADS omp_get_num_threads() /* the team actually started (may be fewer than asked) */
#else
#define THREAD_ID 0
#define THREADS 1
#endif

int rlflow_kernels_openmp(void) {
#ifdef _OPENMP
  return 1;
#else
  return 0;
#endif
}

/* The OpenMP runtime's thread count for the next parallel region (1 without OpenMP): the loader checks
 * that it follows torch.set_num_threads, i.e. that these kernels share torch's runtime. */
int rlflow_kernels_max_threads(void) {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
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
    span(n, THREADS, THREAD_ID, &lo, &hi);  /* part has nt >= THREADS rows; unused ones stay 0 */
    float* pw = part + (int64_t)THREAD_ID * d;
    /* dw over a block of rows, then added to the thread's partial: error ~ (BLOCK + n/BLOCK) eps */
    float* blk = (float*)__builtin_malloc(sizeof(float) * d);
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
    __builtin_free(blk);
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
    float y[W * 64];  /* one head (the caller keeps d <= 512) */
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
    span(n, THREADS, THREAD_ID, &lo, &hi);  /* part has nt >= THREADS rows; unused ones stay 0 */
    float* pw = part + (int64_t)THREAD_ID * hk * d;
    const int64_t half = d / 2;
    float dy[W * 64];  /* one head (the caller keeps d <= 512) */
    float* blk = (float*)__builtin_malloc(sizeof(float) * (normw ? hk * d : 1));  /* dnormw over a block of rows */
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
    __builtin_free(blk);
  }
}

/* ---- Shared-prompt attention (models/prefix.py's packed layout) ----
 * Tokens are packed: P prompts of Tp tokens (left-padded), then B rows of R response tokens (right-padded);
 * the rows of prompt p are rows [row_start[p], row_start[p + 1]). qk [N, H + K, d] holds each token's q heads
 * then its k heads, v [N, K, d], o [N, H, d], lse [N, H] (log-sum-exp of each query's scores, for the
 * backward). A prompt token attends causally among its prompt's valid tokens; a response token to its
 * prompt's valid tokens and causally to its row's valid tokens; every token always sees itself (as
 * ops.causal_padding_mask). Query head h uses key/value head h / (H / K).
 *
 * A "unit" is a prompt's own tokens or one row's response: its keys are a prefix always visible (none for
 * a prompt; the prompt's valid tokens for a row) then its own L tokens, causal. Per (unit, kv head) the
 * keys and values are gathered transposed ([d][keys]) so that 8 keys' scores are one vector. Work is split
 * by prompt: a prompt and its rows are one thread's, so the gradients of the prompt's keys (shared by
 * its rows) need no reduction across threads. */

typedef struct {
  const float* qk; const float* v; const uint8_t* pvalid; const uint8_t* rvalid; const int64_t* row_start;
  int64_t P, Tp, R, H, K, d;
} attn_t;

static inline float dot(const float* x, const float* y, int64_t d) {
  vf acc = vsplat(0.0f);
  for (int64_t j = 0; j < d; j += W) acc += vld(x + j) * vld(y + j);
  return vsum(acc);
}

/* per-thread scratch: the key list, transposed keys/values [d][nmax8], bias [nmax8] (0 or -inf per
 * causal key), scores [nmax8], and (backward) dK, dV rows [nmax][d], a tile's p and ds rows [rows][nmax8]
 * and its queries' q and dO rows */
typedef struct {
  int64_t* tok; float* kt; float* vt; float* bias; float* w; float* dk; float* dv;
  float* pt; float* dst; const float** qp; const float** gp;  /* backward: a tile of queries' p, ds rows */
} scratch_t;

static int64_t unit_keys(const attn_t* a, int64_t p, int64_t row, int64_t* tok, int64_t* npre, int64_t* L,
                         const uint8_t** own_valid, int64_t* own_first) {
  const int64_t Np = a->P * a->Tp;
  int64_t n = 0;
  if (row < 0) {
    *npre = 0;
    *L = a->Tp;
    *own_first = p * a->Tp;
    *own_valid = a->pvalid + p * a->Tp;
  } else {
    for (int64_t s = 0; s < a->Tp; s++)
      if (a->pvalid[p * a->Tp + s]) tok[n++] = p * a->Tp + s;
    *npre = n;
    *L = a->R;
    *own_first = Np + row * a->R;
    *own_valid = a->rvalid + row * a->R;
  }
  for (int64_t s = 0; s < *L; s++) tok[n++] = *own_first + s;
  return n;
}

/* Gather kv head kh of the n keys transposed into kt/vt [d][n8] (n8 = n rounded up to W, zero-padded) and
 * the causal keys' bias (0 valid, -inf padding). */
static void gather_keys(const attn_t* a, const scratch_t* sc, int64_t n, int64_t n8, int64_t npre,
                        const uint8_t* own_valid, int64_t kh) {
  const int64_t HK = a->H + a->K, d = a->d;
  for (int64_t i = 0; i < n8; i++) {
    const float* kk = i < n ? a->qk + (sc->tok[i] * HK + a->H + kh) * d : 0;
    const float* vv = i < n ? a->v + (sc->tok[i] * a->K + kh) * d : 0;
    for (int64_t j = 0; j < d; j++) {
      sc->kt[j * n8 + i] = kk ? kk[j] : 0.f;
      sc->vt[j * n8 + i] = vv ? vv[j] : 0.f;
    }
    sc->bias[i] = i < npre ? 0.f : (i < n && own_valid[i - npre]) ? 0.f : -__builtin_inff();
  }
}

/* out[i] = sum_j x[j] t[j * stride + i] for i in [0, n8) (t transposed, n8 a multiple of W). Four (then
 * two, one) blocks of W outputs at a time: independent accumulators, so the FMAs are not one chain of d. */
static inline void tdot_blocks(const float* x, const float* t, int64_t stride, int64_t d, const int nb, float* out) {
  vf acc[4];
  for (int b = 0; b < nb; b++) acc[b] = vsplat(0.0f);
  for (int64_t j = 0; j < d; j++) {
    const vf xj = vsplat(x[j]);
    for (int b = 0; b < nb; b++) acc[b] += xj * vld(t + j * stride + b * W);
  }
  for (int b = 0; b < nb; b++) vst(out + b * W, acc[b]);
}

static inline void tdot(const float* x, const float* t, int64_t stride, int64_t d, int64_t n8, float* out) {
  int64_t i = 0;
  for (; i + 4 * W <= n8; i += 4 * W) tdot_blocks(x, t + i, stride, d, 4, out + i);
  if (i + 2 * W <= n8) {
    tdot_blocks(x, t + i, stride, d, 2, out + i);
    i += 2 * W;
  }
  if (i < n8) tdot_blocks(x, t + i, stride, d, 1, out + i);
}

/* out[j] = mul sum_i w[i] base[tok[i] * stride + j] for j in [0, d): rows gathered by token, four (then
 * two, one) column blocks of W in registers over the rows. */
static inline void wsum_blocks(const float* w, int64_t n, const int64_t* tok, const float* base, int64_t stride,
                               const int nb, float mul, float* out) {
  vf acc[4];
  for (int b = 0; b < nb; b++) acc[b] = vsplat(0.0f);
  for (int64_t i = 0; i < n; i++) {
    const vf wi = vsplat(w[i]);
    const float* r = base + tok[i] * stride;
    for (int b = 0; b < nb; b++) acc[b] += wi * vld(r + b * W);
  }
  for (int b = 0; b < nb; b++) vst(out + b * W, acc[b] * vsplat(mul));
}

static inline void wsum(const float* w, int64_t n, const int64_t* tok, const float* base, int64_t stride, int64_t d,
                        float mul, float* out) {
  int64_t j = 0;
  for (; j + 4 * W <= d; j += 4 * W) wsum_blocks(w, n, tok, base + j, stride, 4, mul, out + j);
  if (j + 2 * W <= d) {
    wsum_blocks(w, n, tok, base + j, stride, 2, mul, out + j);
    j += 2 * W;
  }
  if (j < d) wsum_blocks(w, n, tok, base + j, stride, 1, mul, out + j);
}

/* Scores of query q (causal position t) against keys [0, n8) into w, with the mask: keys past npre + t and
 * padding are -inf, except the query's own key. kt's rows are `stride` long. Returns the max. */
static inline float scores(const scratch_t* sc, const float* q, int64_t d, int64_t stride, int64_t n8, int64_t npre,
                           int64_t t, float scale) {
  const int64_t last = npre + t;  /* the query's own key */
  const vi lane = {0, 1, 2, 3, 4, 5, 6, 7};
  const vf ninf = vsplat(-__builtin_inff());
  vf mx = ninf;
  tdot(q, sc->kt, stride, d, n8, sc->w);
  for (int64_t i = 0; i < n8; i += W) {
    vf acc = vld(sc->w + i) * vsplat(scale) + vld(sc->bias + i);
    if (i + W > last) acc = vsel(lane + (int32_t)i > (int32_t)last, ninf, acc);
    vst(sc->w + i, acc);
    mx = vsel(acc > mx, acc, mx);
  }
  float m = mx[0];
  for (int l = 1; l < W; l++) m = mx[l] > m ? mx[l] : m;
  if (sc->bias[last] != 0.f) {  /* itself, though padding */
    float s = 0.f;
    for (int64_t j = 0; j < d; j++) s += q[j] * sc->kt[j * stride + last];
    sc->w[last] = s * scale;
    m = sc->w[last] > m ? sc->w[last] : m;
  }
  return m;
}

/* w <- exp(w - shift) (exactly 0 where w is -inf); returns the sum */
static inline float exp_shift(float* w, int64_t n8, float shift) {
  vf sum = vsplat(0.0f);
  for (int64_t i = 0; i < n8; i += W) {
    vf x = vld(w + i);
    vf e = vsel(x == vsplat(-__builtin_inff()), vsplat(0.0f), vexp(x - vsplat(shift)));
    vst(w + i, e);
    sum += e;
  }
  return vsum(sum);
}

/* Queries per tile of the backward (tokens x the query heads of one kv head): their p and ds rows are kept
 * so that each key's dk, dv sum over the tile in registers. */
#define QTILE 32

/* backward: `rows` queries a tile at most (0 in the forward) */
static void scratch_alloc(scratch_t* sc, int64_t nmax, int64_t d, int64_t rows) {
  const int backward = rows > 0;
  const int64_t n8 = (nmax + W - 1) / W * W, tile = 2 * rows * n8;
  sc->tok = (int64_t*)__builtin_malloc(sizeof(int64_t) * n8);
  float* f = (float*)__builtin_malloc(sizeof(float) * (n8 * (2 * d + 2) + (backward ? 2 * n8 * d : 0) + tile));
  sc->kt = f;
  sc->vt = f + n8 * d;
  sc->bias = f + 2 * n8 * d;
  sc->w = sc->bias + n8;
  sc->dk = backward ? sc->w + n8 : 0;
  sc->dv = backward ? sc->dk + n8 * d : 0;
  sc->pt = backward ? sc->dv + n8 * d : 0;
  sc->dst = backward ? sc->pt + rows * n8 : 0;
  sc->qp = backward ? (const float**)__builtin_malloc(sizeof(float*) * 2 * rows) : 0;
  sc->gp = backward ? sc->qp + rows : 0;
}

static void scratch_free(scratch_t* sc) {
  __builtin_free(sc->tok);
  __builtin_free(sc->kt);
  if (sc->qp) __builtin_free((void*)sc->qp);
}

/* dk += sum_r ds[r] q_r, dv += sum_r p[r] g_r over the tile's queries r in [r0, nq) (ds, p: one key's column
 * of the tile, rows `stride` apart), for column blocks [j, j + nb W): the sums in registers. */
static inline void kv_blocks(const float* ds, const float* p, int64_t stride, const float* const* qp,
                             const float* const* gp, int64_t r0, int64_t nq, int64_t j, const int nb, float* dk,
                             float* dv) {
  vf ak[4], av[4];
  for (int b = 0; b < nb; b++) ak[b] = av[b] = vsplat(0.0f);
  for (int64_t r = r0; r < nq; r++) {
    const vf a = vsplat(ds[r * stride]), c = vsplat(p[r * stride]);
    const float* q = qp[r] + j;
    const float* g = gp[r] + j;
    for (int b = 0; b < nb; b++) {
      ak[b] += a * vld(q + b * W);
      av[b] += c * vld(g + b * W);
    }
  }
  for (int b = 0; b < nb; b++) {
    vst(dk + j + b * W, vld(dk + j + b * W) + ak[b]);
    vst(dv + j + b * W, vld(dv + j + b * W) + av[b]);
  }
}

static inline void kv_accumulate(const float* ds, const float* p, int64_t stride, const float* const* qp,
                                 const float* const* gp, int64_t r0, int64_t nq, int64_t d, float* dk, float* dv) {
  int64_t j = 0;
  for (; j + 4 * W <= d; j += 4 * W) kv_blocks(ds, p, stride, qp, gp, r0, nq, j, 4, dk, dv);
  if (j + 2 * W <= d) {
    kv_blocks(ds, p, stride, qp, gp, r0, nq, j, 2, dk, dv);
    j += 2 * W;
  }
  if (j < d) kv_blocks(ds, p, stride, qp, gp, r0, nq, j, 1, dk, dv);
}

void prefix_attn_fwd(const float* qk, const float* v, const uint8_t* pvalid, const uint8_t* rvalid,
                     const int64_t* row_start, int64_t P, int64_t Tp, int64_t R, int64_t H, int64_t K, int64_t d,
                     float* o, float* lse) {
  const attn_t a = {qk, v, pvalid, rvalid, row_start, P, Tp, R, H, K, d};
  const float scale = 1.0f / __builtin_sqrtf((float)d);
  const int64_t G = H / K, HK = H + K;
#pragma omp parallel
  {
    scratch_t sc;
    scratch_alloc(&sc, Tp + R, d, 0);
#pragma omp for schedule(dynamic, 1)
    for (int64_t p = 0; p < P; p++) {
      for (int64_t row = -1; row < row_start[p + 1]; row = row < 0 ? row_start[p] : row + 1) {  /* prompt, rows */
        int64_t npre, L, own_first;
        const uint8_t* own_valid;
        const int64_t n = unit_keys(&a, p, row, sc.tok, &npre, &L, &own_valid, &own_first);
        const int64_t n8 = (n + W - 1) / W * W;
        for (int64_t kh = 0; kh < K; kh++) {
          gather_keys(&a, &sc, n, n8, npre, own_valid, kh);
          for (int64_t t = 0; t < L; t++) {
            const int64_t tq = own_first + t, nt8 = (npre + t + 1 + W - 1) / W * W;
            for (int64_t h = kh * G; h < (kh + 1) * G; h++) {
              const float m = scores(&sc, qk + (tq * HK + h) * d, d, n8, nt8, npre, t, scale);
              const float sum = exp_shift(sc.w, nt8, m);
              lse[tq * H + h] = m + __builtin_logf(sum);
              wsum(sc.w, npre + t + 1, sc.tok, v + kh * d, K * d, d, 1.0f / sum, o + (tq * H + h) * d);
            }
          }
        }
      }
    }
    scratch_free(&sc);
  }
}

/* p = exp(score - lse), ds = p (dO.v - dO.o); dq = scale sum_s ds_s k_s, dk_s += scale ds_s q, dv_s += p_s dO.
 * dqk's q and k slots and dv are written in full (zero where a token is never a key). */
void prefix_attn_bwd(const float* qk, const float* v, const uint8_t* pvalid, const uint8_t* rvalid,
                     const int64_t* row_start, int64_t P, int64_t Tp, int64_t R, int64_t H, int64_t K, int64_t d,
                     const float* o, const float* lse, const float* dout, float* dqk, float* dv) {
  const attn_t a = {qk, v, pvalid, rvalid, row_start, P, Tp, R, H, K, d};
  const float scale = 1.0f / __builtin_sqrtf((float)d);
  const int64_t G = H / K, HK = H + K, Np = P * Tp;
#pragma omp parallel
  {
    scratch_t sc;
    const int64_t TQ = QTILE / G > 0 ? QTILE / G : 1;  /* tokens per tile of queries */
    scratch_alloc(&sc, Tp + R, d, TQ * G);
#pragma omp for schedule(dynamic, 1)
    for (int64_t p = 0; p < P; p++) {
      /* zero the k slots and dv of this prompt's tokens and its rows' tokens (keys accumulate) */
      for (int64_t row = -1; row < row_start[p + 1]; row = row < 0 ? row_start[p] : row + 1) {
        const int64_t first = row < 0 ? p * Tp : Np + row * R, T = row < 0 ? Tp : R;
        for (int64_t t = first; t < first + T; t++) {
          for (int64_t j = 0; j < K * d; j++) dqk[(t * HK + H) * d + j] = 0.f;
          for (int64_t j = 0; j < K * d; j++) dv[t * K * d + j] = 0.f;
        }
      }
      for (int64_t row = -1; row < row_start[p + 1]; row = row < 0 ? row_start[p] : row + 1) {
        int64_t npre, L, own_first;
        const uint8_t* own_valid;
        const int64_t n = unit_keys(&a, p, row, sc.tok, &npre, &L, &own_valid, &own_first);
        const int64_t n8 = (n + W - 1) / W * W;
        for (int64_t kh = 0; kh < K; kh++) {
          gather_keys(&a, &sc, n, n8, npre, own_valid, kh);
          for (int64_t i = 0; i < n * d; i++) sc.dk[i] = sc.dv[i] = 0.f;
          for (int64_t t0 = 0; t0 < L; t0 += TQ) {
            const int64_t t1 = t0 + TQ < L ? t0 + TQ : L, nq = (t1 - t0) * G;
            const int64_t nk = npre + t1, nk8 = (nk + W - 1) / W * W;  /* the keys the tile's queries see */
            for (int64_t t = t0; t < t1; t++) {
              const int64_t tq = own_first + t, nt8 = (npre + t + 1 + W - 1) / W * W, nt = npre + t + 1;
              for (int64_t h = kh * G; h < (kh + 1) * G; h++) {
                const int64_t qi = tq * H + h, r = (t - t0) * G + (h - kh * G);
                const float* q = qk + (tq * HK + h) * d;
                const float* g = dout + qi * d;
                float* pr = sc.pt + r * nk8;
                float* dr = sc.dst + r * nk8;
                sc.qp[r] = q;
                sc.gp[r] = g;
                const float delta = dot(g, o + qi * d, d);
                scores(&sc, q, d, n8, nt8, npre, t, scale);
                exp_shift(sc.w, nt8, lse[qi]);  /* p */
                tdot(g, sc.vt, n8, d, nt8, dr);  /* dO.v_s */
                for (int64_t i = 0; i < nt8; i += W) {  /* ds = p (dO.v_s - delta) */
                  const vf pi = vld(sc.w + i);
                  vst(pr + i, pi);
                  vst(dr + i, pi * (vld(dr + i) - vsplat(delta)) * vsplat(scale));
                }
                for (int64_t i = nt8; i < nk8; i++) pr[i] = dr[i] = 0.f;  /* keys past this query's */
                wsum(dr, nt, sc.tok, qk + (H + kh) * d, HK * d, d, 1.0f, dqk + (tq * HK + h) * d);  /* dq */
              }
            }
            for (int64_t i = 0; i < nk; i++) {  /* key i: the queries from its own position on see it */
              const int64_t first = i < npre ? 0 : i - npre, r0 = (first > t0 ? first - t0 : 0) * G;
              if (r0 < nq) kv_accumulate(sc.dst + i, sc.pt + i, nk8, sc.qp, sc.gp, r0, nq, d, sc.dk + i * d, sc.dv + i * d);
            }
          }
          for (int64_t i = 0; i < n; i++) {  /* the unit's key gradients into their tokens' slots */
            float* dk = dqk + (sc.tok[i] * HK + H + kh) * d;
            float* dvv = dv + (sc.tok[i] * K + kh) * d;
            for (int64_t j = 0; j < d; j += W) {
              vst(dk + j, vld(dk + j) + vld(sc.dk + i * d + j));
              vst(dvv + j, vld(dvv + j) + vld(sc.dv + i * d + j));
            }
          }
        }
      }
    }
    scratch_free(&sc);
  }
}

/* ---- Routed experts for a few tokens on small experts (decode, inference only) ----
 * out[r] = sum_s w[r, s] down_e(silu(gate_e x_r) * up_e x_r), e = idx[r, s], from the experts' weights
 * transposed: guT [E, D, 2F] (gate then up columns), downT [E, F, D]. The (token, slot) pairs are grouped
 * by expert, and each expert runs on tiles of TILE pairs: every weight vector loaded is used TILE times,
 * from registers. A pair's result goes to its own row of y [n * k, D]; the k rows of a token are summed
 * at the end (no two threads write one row). Only the routed experts are computed: k/E of the dense
 * FLOPs. Weights stay in cache when a layer's experts are small (the caller checks). */
#define TILE 4

static void expert_tile(const float* x, const int64_t* pair, int64_t tb, int64_t k, const float* w, const float* gu,
                        const float* dn, int64_t D, int64_t F, float* h, float* y) {
  const float* xr[TILE];
  for (int t = 0; t < TILE; t++) xr[t] = x + (pair[t < tb ? t : 0] / k) * D;  /* tail: repeat, discarded */
  for (int64_t j = 0; j < 2 * F; j += 2 * W) {  /* h[t] = x[t] guT: 2 vectors of columns at a time */
    vf a0[TILE], a1[TILE];
    for (int t = 0; t < TILE; t++) a0[t] = a1[t] = vsplat(0.0f);
    for (int64_t d = 0; d < D; d++) {
      const vf w0 = vld(gu + d * 2 * F + j), w1 = vld(gu + d * 2 * F + j + W);
      for (int t = 0; t < TILE; t++) {
        const vf xb = vsplat(xr[t][d]);
        a0[t] += xb * w0;
        a1[t] += xb * w1;
      }
    }
    for (int t = 0; t < TILE; t++) {
      vst(h + t * 2 * F + j, a0[t]);
      vst(h + t * 2 * F + j + W, a1[t]);
    }
  }
  for (int t = 0; t < TILE; t++) {  /* a = silu(gate) * up * routing weight, into h's first F */
    const vf wk = vsplat(t < tb ? w[pair[t]] : 0.0f);
    for (int64_t j = 0; j < F; j += W) {
      const vf g = vld(h + t * 2 * F + j);
      vst(h + t * 2 * F + j, g * vsigmoid(g) * vld(h + t * 2 * F + F + j) * wk);
    }
  }
  for (int64_t j = 0; j < D; j += 2 * W) {  /* y[t] = a[t] downT */
    vf a0[TILE], a1[TILE];
    for (int t = 0; t < TILE; t++) a0[t] = a1[t] = vsplat(0.0f);
    for (int64_t f = 0; f < F; f++) {
      const vf w0 = vld(dn + f * D + j), w1 = vld(dn + f * D + j + W);
      for (int t = 0; t < TILE; t++) {
        const vf ab = vsplat(h[t * 2 * F + f]);
        a0[t] += ab * w0;
        a1[t] += ab * w1;
      }
    }
    for (int t = 0; t < tb; t++) {
      vst(y + pair[t] * D + j, a0[t]);
      vst(y + pair[t] * D + j + W, a1[t]);
    }
  }
}

/* Needs D and F multiples of 2 * W; E experts. */
int moe_small_fwd(const float* x, const int64_t* idx, const float* w, const float* guT, const float* downT,
                  int64_t n, int64_t k, int64_t E, int64_t D, int64_t F, float* out) {
  for (int64_t i = 0; i < n * k; i++)
    if (idx[i] < 0 || idx[i] >= E) return -1;  /* an expert id out of [0, E) */
  float* y = (float*)__builtin_malloc(sizeof(float) * (n * k * D + 1));  /* each pair's result row */
  int64_t* order = (int64_t*)__builtin_malloc(sizeof(int64_t) * (n * k + 1));
  int64_t start[E + 1];
  for (int64_t e = 0; e <= E; e++) start[e] = 0;
  for (int64_t i = 0; i < n * k; i++) start[idx[i] + 1]++;
  for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
  int64_t fill[E];
  for (int64_t e = 0; e < E; e++) fill[e] = start[e];
  for (int64_t i = 0; i < n * k; i++) order[fill[idx[i]]++] = i;  /* pairs grouped by expert, stable */
  const int64_t ntiles_max = n * k / TILE + E;
#pragma omp parallel
  {
    float* h = (float*)__builtin_malloc(sizeof(float) * TILE * 2 * F);
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < ntiles_max; u++) {  /* tile u: the u-th tile in expert order */
      int64_t e = 0, before = 0;
      for (; e < E; e++) {
        const int64_t nt = (start[e + 1] - start[e] + TILE - 1) / TILE;
        if (u < before + nt) break;
        before += nt;
      }
      if (e == E) continue;
      const int64_t first = start[e] + (u - before) * TILE;
      const int64_t tb = start[e + 1] - first < TILE ? start[e + 1] - first : TILE;
      expert_tile(x, order + first, tb, k, w, guT + e * D * 2 * F, downT + e * F * D, D, F, h, y);
    }
#pragma omp for schedule(static)
    for (int64_t r = 0; r < n; r++)
      for (int64_t j = 0; j < D; j += W) {
        vf acc = vld(y + (r * k) * D + j);
        for (int64_t s = 1; s < k; s++) acc += vld(y + (r * k + s) * D + j);
        vst(out + r * D + j, acc);
      }
    __builtin_free(h);
  }
  __builtin_free(y);
  __builtin_free(order);
  return 0;
}

/* ---- MoE token plumbing for the grouped expert path (training) ----
 * moe_plan: the n*k (token, slot) pairs sorted by expert (stable): order[j] = the pair at sorted position j,
 * tok[j] = its token, inv[pair] = its sorted position; offs[e] = end of expert e's block (grouped GEMM's
 * offsets). A counting sort: O(n k + E). */
int moe_plan(const int64_t* idx, int64_t n, int64_t k, int64_t E, int64_t* order, int64_t* tok, int64_t* inv,
             int32_t* offs) {
  for (int64_t i = 0; i < n * k; i++)
    if (idx[i] < 0 || idx[i] >= E) return -1;  /* an expert id out of [0, E) */
  int64_t fill[E];
  for (int64_t e = 0; e < E; e++) fill[e] = 0;
  for (int64_t i = 0; i < n * k; i++) fill[idx[i]]++;
  int64_t run = 0;
  for (int64_t e = 0; e < E; e++) {
    const int64_t c = fill[e];
    fill[e] = run;
    run += c;
    offs[e] = (int32_t)run;
  }
  for (int64_t i = 0; i < n * k; i++) {
    const int64_t j = fill[idx[i]]++;
    order[j] = i;
    tok[j] = i / k;
    inv[i] = j;
  }
  return 0;
}

/* out[r] = sum_s src[inv[r k + s]] (rows of D): the k sorted rows of each token, summed (no atomics: each
 * output row is one thread's). */
void gather_sum(const float* src, const int64_t* inv, int64_t n, int64_t k, int64_t D, float* out) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < n; r++)
    for (int64_t j = 0; j < D; j += W) {
      vf acc = vld(src + inv[r * k] * D + j);
      for (int64_t s = 1; s < k; s++) acc += vld(src + inv[r * k + s] * D + j);
      vst(out + r * D + j, acc);
    }
}

/* ---- Softmax top-k routing (Qwen3-MoE), forward and backward ----
 * probs = softmax(logits) per row of E; the top k (largest first, ties to the lower expert) with weights
 * p (normalized to sum 1 when norm). Backward from dw: with S = sum of the chosen p, dp_chosen = dw / S
 * - (sum_j dw_j w_j) / S when normalized (else dw); dlogits = p (dp - sum_e p_e dp_e), dp = 0 elsewhere. */
void router_fwd(const float* logits, int64_t n, int64_t E, int64_t k, int norm, float* w, int64_t* idx,
                float* probs) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < n; r++) {
    const float* l = logits + r * E;
    float* p = probs + r * E;
    float m = l[0];
    for (int64_t e = 1; e < E; e++) m = l[e] > m ? l[e] : m;
    float sum = 0.f;
    for (int64_t e = 0; e < E; e++) {
      p[e] = vexp(vsplat(l[e] - m))[0];
      sum += p[e];
    }
    for (int64_t e = 0; e < E; e++) p[e] /= sum;
    float chosen = 0.f;
    for (int64_t s = 0; s < k; s++) {
      int64_t best = -1;
      for (int64_t e = 0; e < E; e++) {
        int taken = 0;
        for (int64_t t = 0; t < s; t++) taken |= idx[r * k + t] == e;
        if (!taken && (best < 0 || p[e] > p[best])) best = e;
      }
      idx[r * k + s] = best;
      w[r * k + s] = p[best];
      chosen += p[best];
    }
    if (norm)
      for (int64_t s = 0; s < k; s++) w[r * k + s] /= chosen;
  }
}

void router_bwd(const float* probs, const int64_t* idx, const float* w, const float* dw, int64_t n, int64_t E,
                int64_t k, int norm, float* dlogits) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < n; r++) {
    const float* p = probs + r * E;
    float S = 0.f, c = 0.f;
    for (int64_t s = 0; s < k; s++) {
      S += p[idx[r * k + s]];
      c += dw[r * k + s] * w[r * k + s];
    }
    float dp[k], dot = 0.f;
    for (int64_t s = 0; s < k; s++) {
      dp[s] = norm ? (dw[r * k + s] - c) / S : dw[r * k + s];
      dot += p[idx[r * k + s]] * dp[s];
    }
    float* dl = dlogits + r * E;
    for (int64_t e = 0; e < E; e++) dl[e] = -p[e] * dot;
    for (int64_t s = 0; s < k; s++) dl[idx[r * k + s]] += p[idx[r * k + s]] * dp[s];
  }
}


/* ---- counter-based sampling noise (rlflow.ops.counter_noise) ---- */
static inline uint64_t mix64(uint64_t x) {
  x ^= x >> 30; x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27; x *= 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

/* out[b, v] = -log(U), U = (bits 40..63 of mix(mix(key_b + pos_b * M2) + v) + 0.5) / 2^24: the same
   integers as the torch reference (wrapping uint64 arithmetic). */
void counter_noise_fwd(const int64_t* keys, const int64_t* pos, int64_t n, int64_t vocab, float* out) {
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < n; b++) {
    const uint64_t k = mix64((uint64_t)keys[b] + (uint64_t)pos[b] * 0x94d049bb133111ebULL);
    float* o = out + b * vocab;
    for (int64_t v = 0; v < vocab; v++) {
      const uint64_t x = mix64(k + (uint64_t)v);
      o[v] = -logf(((float)(x >> 40) + 0.5f) * (1.0f / 16777216.0f));
    }
  }
}
