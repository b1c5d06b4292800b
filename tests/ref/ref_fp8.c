/* SPDX-License-Identifier: Apache-2.0 */
/* ref_fp8: float64 reference of an fp8 layer, straight from docs/math.md
 * ("FP8 (e4m3, block-scaled)"). One (token, slot) at a time, as ref64.
 * Independent of the engines' code and of kernels/common/fp8_e4m3.h. */
#include "ref_fp8.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define BLK 128

/* v rounded to a grid of step 2^q_exp, ties to even (nearbyint's default mode). */
static double round_to_step(double a, int q_exp) { return ldexp(nearbyint(ldexp(a, -q_exp)), q_exp); }

double ref_fp8_e4m3(double v) {
  if (isnan(v)) return v;
  double a = fabs(v);
  if (a == 0.0) return v;
  int ex;
  frexp(a, &ex); /* a in [2^(ex-1), 2^ex) */
  /* three mantissa bits in the binades from 2^-6, steps of 2^-9 below */
  double r = round_to_step(a, a >= 0x1p-6 ? ex - 1 - 3 : -9);
  if (r > 448.0) r = 448.0; /* 464 rounds to 448 (even), above it to 480: saturated */
  return copysign(r, v);
}

double ref_fp8_bf16(double v) {
  if (isnan(v) || v == 0.0 || isinf(v)) return v;
  int ex;
  frexp(fabs(v), &ex);
  int q = ex - 1 - 7;
  if (q < -133) q = -133; /* bf16 subnormals: steps of 2^-133 */
  return copysign(round_to_step(fabs(v), q), v);
}

int ref_fp8_scale_exp(double amax) {
  if (amax == 0.0) return 0;
  for (int e = -126; e < 127; e++)
    if (ldexp(amax, -e) <= 448.0) return e;
  return 127;
}

/* One block of n values at stride: q = e4m3(x * 2^-e), returns 2^e. */
static double quantize_block(const double *x, size_t n, size_t stride, double *q) {
  double amax = 0.0;
  for (size_t i = 0; i < n; i++)
    if (fabs(x[i * stride]) > amax) amax = fabs(x[i * stride]);
  int e = ref_fp8_scale_exp(amax);
  for (size_t i = 0; i < n; i++) q[i * stride] = ref_fp8_e4m3(ldexp(x[i * stride], -e));
  return ldexp(1.0, e);
}

void ref_fp8_quantize_weight(const double *w, int E, int N, int K, double *q, double *s) {
  int nb = N / BLK, kb = K / BLK;
  for (int e = 0; e < E; e++)
    for (int bn = 0; bn < nb; bn++)
      for (int bk = 0; bk < kb; bk++) {
        double amax = 0.0;
        for (int n = 0; n < BLK; n++)
          for (int k = 0; k < BLK; k++) {
            double v = fabs(w[((size_t)e * N + bn * BLK + n) * K + bk * BLK + k]);
            if (v > amax) amax = v;
          }
        int ex = ref_fp8_scale_exp(amax);
        for (int n = 0; n < BLK; n++)
          for (int k = 0; k < BLK; k++) {
            size_t at = ((size_t)e * N + bn * BLK + n) * K + bk * BLK + k;
            q[at] = ref_fp8_e4m3(ldexp(w[at], -ex));
          }
        s[((size_t)e * nb + bn) * kb + bk] = ldexp(1.0, ex);
      }
}

/* A row quantised in blocks of 128: q [n], s [n/128]. */
static void quantize_row(const double *x, int n, double *q, double *s) {
  for (int b = 0; b < n / BLK; b++) s[b] = quantize_block(x + b * BLK, BLK, 1, q + b * BLK);
}

/* One expert's quantised weights: w [N, K] as q, s [N/128, K/128]. */
typedef struct qmat {
  const double *q, *s;
  int N, K;
} qmat;

/* Σ_kb s_a[kb]·s_w(n, kb)·Σ_{k in kb} qa[k]·w(n, k): the row times the
 * matrix (over its K: w(n,k) = q[n,k]) or its transpose (over its N:
 * w(n,k) = q[k,n], the block scales read transposed). */
static double fp8_dot(const double *qa, const double *sa, const qmat *w, int n, int transposed) {
  int len = transposed ? w->N : w->K, kbs = w->K / BLK;
  double acc = 0.0;
  for (int b = 0; b < len / BLK; b++) {
    double inner = 0.0;
    for (int k = b * BLK; k < (b + 1) * BLK; k++)
      inner += qa[k] * (transposed ? w->q[(size_t)k * w->K + n] : w->q[(size_t)n * w->K + k]);
    double sw = transposed ? w->s[(size_t)b * kbs + n / BLK] : w->s[(size_t)(n / BLK) * kbs + b];
    acc += sa[b] * sw * inner;
  }
  return acc;
}

typedef struct ffn8 {
  int H, n; /* n: this FFN's intermediate */
  qmat g, u, d;
  int has_limit;
  double limit;
} ffn8;

static double sigmoid64(double v) { return 1.0 / (1.0 + exp(-v)); }
static double silu64(double v) { return v * sigmoid64(v); }

static void clamp_gu(const ffn8 *f, double g, double u, double *gc, double *uc, double *pg,
                     double *pu) {
  *gc = g, *uc = u, *pg = 1.0, *pu = 1.0;
  if (!f->has_limit) return;
  if (g > f->limit) *gc = f->limit, *pg = 0.0;
  if (u > f->limit) *uc = f->limit, *pu = 0.0;
  if (u < -f->limit) *uc = -f->limit, *pu = 0.0;
}

/* g, u (bf16, pre-clamp) and h = bf16(silu(g')·u') of one input row. */
static void ffn8_hidden(const ffn8 *f, const double *xrow, double *g, double *u, double *h,
                        double *scratch) {
  double *qx = scratch, *sx = scratch + f->H;
  quantize_row(xrow, f->H, qx, sx);
  for (int i = 0; i < f->n; i++) {
    g[i] = ref_fp8_bf16(fp8_dot(qx, sx, &f->g, i, 0));
    u[i] = ref_fp8_bf16(fp8_dot(qx, sx, &f->u, i, 0));
    double gc, uc, pg, pu;
    clamp_gu(f, g[i], u[i], &gc, &uc, &pg, &pu);
    h[i] = ref_fp8_bf16(silu64(gc) * uc);
  }
}

/* y = bf16(h · W_down^T) in FP8 */
static void ffn8_down(const ffn8 *f, const double *h, double *y, double *scratch) {
  double *qh = scratch, *sh = scratch + f->n;
  quantize_row(h, f->n, qh, sh);
  for (int j = 0; j < f->H; j++) y[j] = ref_fp8_bf16(fp8_dot(qh, sh, &f->d, j, 0));
}

typedef struct ref_weights {
  double *q[6], *s[6]; /* wg, wu, wd, sg, su, sd */
} ref_weights;

static void weights_quantize(const ref64_layer *L, const ref64_inputs *in, ref_weights *w) {
  const double *src[6] = {in->wg, in->wu, in->wd, in->sg, in->su, in->sd};
  for (int i = 0; i < 6; i++) {
    int shared = i >= 3, down = i % 3 == 2;
    int E = shared ? 1 : L->E_loc, n = shared ? L->I_s : L->I;
    int N = down ? L->H : n, K = down ? n : L->H;
    w->q[i] = w->s[i] = NULL;
    if (shared && L->I_s == 0) continue;
    w->q[i] = malloc(sizeof(double) * (size_t)E * N * K);
    w->s[i] = malloc(sizeof(double) * (size_t)E * (N / BLK) * (K / BLK) + 1);
    if (!w->q[i] || !w->s[i]) abort();
    ref_fp8_quantize_weight(src[i], E, N, K, w->q[i], w->s[i]);
  }
}

static void weights_free(ref_weights *w) {
  for (int i = 0; i < 6; i++) free(w->q[i]), free(w->s[i]);
}

static ffn8 ffn_of(const ref64_layer *L, const ref_weights *w, int shared, int e) {
  int n = shared ? L->I_s : L->I, b = shared ? 3 : 0;
  size_t per = (size_t)n * L->H, sper = per / (BLK * BLK);
  ffn8 f = {L->H, n,
            {w->q[b] + e * per, w->s[b] + e * sper, n, L->H},
            {w->q[b + 1] + e * per, w->s[b + 1] + e * sper, n, L->H},
            {w->q[b + 2] + e * per, w->s[b + 2] + e * sper, L->H, n},
            L->has_limit, L->limit};
  return f;
}

static int local_expert(const ref64_layer *L, const ref64_inputs *in, int t, int k) {
  int32_t id = in->ids[(size_t)t * L->K + k];
  if (id < L->first_expert || id >= L->first_expert + L->E_loc) return -1;
  return id - L->first_expert;
}

static int widest(const ref64_layer *L) {
  int n = L->I > L->I_s ? L->I : L->I_s;
  return 2 * (n > L->H ? n : L->H) + 2;
}

void ref_fp8_forward(const ref64_layer *L, const ref64_inputs *in, double *out) {
  ref_weights w;
  weights_quantize(L, in, &w);
  int n = widest(L);
  double *g = malloc(sizeof(double) * n), *u = malloc(sizeof(double) * n),
         *h = malloc(sizeof(double) * n), *y = malloc(sizeof(double) * n),
         *scr = malloc(sizeof(double) * 2 * n);
  if (!g || !u || !h || !y || !scr) abort();
  for (int t = 0; t < L->T; t++) {
    const double *xrow = in->x + (size_t)t * L->H;
    double *orow = out + (size_t)t * L->H;
    memset(orow, 0, sizeof(double) * L->H);
    if (L->I_s > 0) { /* acc starts at shared_y */
      ffn8 f = ffn_of(L, &w, 1, 0);
      ffn8_hidden(&f, xrow, g, u, h, scr);
      ffn8_down(&f, h, orow, scr);
    }
    for (int k = 0; k < L->K; k++) {
      int e = local_expert(L, in, t, k);
      if (e < 0) continue;
      ffn8 f = ffn_of(L, &w, 0, e);
      ffn8_hidden(&f, xrow, g, u, h, scr);
      ffn8_down(&f, h, y, scr);
      for (int j = 0; j < L->H; j++) orow[j] += in->rw[(size_t)t * L->K + k] * y[j];
    }
    for (int j = 0; j < L->H; j++) orow[j] = ref_fp8_bf16(orow[j]);
  }
  weights_free(&w);
  free(g), free(u), free(h), free(y), free(scr);
}

/* Backward of one (row, rw): adds dx (unrounded, as f32 would) into dx_acc
 * after rounding the row's own dx to bf16, the weight gradients into dw*;
 * returns d_rw. */
static double ffn8_backward_add(const ffn8 *f, const double *xrow, const double *dout, double rw,
                                double *dx_acc, double *dwg, double *dwu, double *dwd,
                                double *buf) {
  const int H = f->H, n = f->n;
  double *g = buf, *u = g + n, *h = u + n, *dg = h + n, *du = dg + n, *scr = du + n;
  ffn8_hidden(f, xrow, g, u, h, scr);
  double *qdo = scr, *sdo = scr + H; /* after ffn8_hidden: free again */
  quantize_row(dout, H, qdo, sdo);
  double drw = 0.0;
  for (int i = 0; i < n; i++) {
    double a = fp8_dot(qdo, sdo, &f->d, i, 1); /* over H: W_down's blocks transposed */
    drw += a * h[i];
    double dh = rw * a, gc, uc, pg, pu;
    clamp_gu(f, g[i], u[i], &gc, &uc, &pg, &pu);
    double s = sigmoid64(gc);
    dg[i] = ref_fp8_bf16(dh * uc * (s * (1.0 + gc * (1.0 - s))) * pg);
    du[i] = ref_fp8_bf16(dh * silu64(gc) * pu);
  }
  double *qg = scr, *sg = qg + n, *qu = sg + n, *su = qu + n;
  quantize_row(dg, n, qg, sg);
  quantize_row(du, n, qu, su);
  for (int j = 0; j < H; j++) /* one sum over the blocks of [dg | du] */
    dx_acc[j] += ref_fp8_bf16(fp8_dot(qg, sg, &f->g, j, 1) + fp8_dot(qu, su, &f->u, j, 1));
  /* d_w_down from d_out and h~ = bf16(rw h), as the bf16 layer's recipe */
  for (int i = 0; i < n; i++) h[i] = ref_fp8_bf16(rw * h[i]);
  for (int j = 0; j < H; j++)
    for (int i = 0; i < n; i++) dwd[(size_t)j * n + i] += dout[j] * h[i];
  for (int i = 0; i < n; i++)
    for (int c = 0; c < H; c++) {
      dwg[(size_t)i * H + c] += dg[i] * xrow[c];
      dwu[(size_t)i * H + c] += du[i] * xrow[c];
    }
  return drw;
}

static void round_all(double *v, size_t n) {
  for (size_t i = 0; i < n; i++) v[i] = ref_fp8_bf16(v[i]);
}

void ref_fp8_backward(const ref64_layer *L, const ref64_inputs *in, const double *d_out,
                      double *d_x, double *d_rw, double *d_wg, double *d_wu, double *d_wd,
                      double *d_sg, double *d_su, double *d_sd) {
  ref_weights w;
  weights_quantize(L, in, &w);
  size_t per = (size_t)L->I * L->H, sper = (size_t)L->I_s * L->H;
  memset(d_x, 0, sizeof(double) * L->T * L->H);
  memset(d_rw, 0, sizeof(double) * L->T * L->K);
  memset(d_wg, 0, sizeof(double) * L->E_loc * per);
  memset(d_wu, 0, sizeof(double) * L->E_loc * per);
  memset(d_wd, 0, sizeof(double) * L->E_loc * per);
  if (L->I_s > 0) {
    memset(d_sg, 0, sizeof(double) * sper);
    memset(d_su, 0, sizeof(double) * sper);
    memset(d_sd, 0, sizeof(double) * sper);
  }
  double *buf = malloc(sizeof(double) * 8 * (size_t)widest(L));
  if (!buf) abort();
  for (int t = 0; t < L->T; t++) {
    const double *xrow = in->x + (size_t)t * L->H, *dy = d_out + (size_t)t * L->H;
    double *dx = d_x + (size_t)t * L->H;
    if (L->I_s > 0) {
      ffn8 f = ffn_of(L, &w, 1, 0);
      ffn8_backward_add(&f, xrow, dy, 1.0, dx, d_sg, d_su, d_sd, buf);
    }
    for (int k = 0; k < L->K; k++) {
      int e = local_expert(L, in, t, k);
      if (e < 0) continue;
      ffn8 f = ffn_of(L, &w, 0, e);
      size_t slot = (size_t)t * L->K + k;
      d_rw[slot] = ffn8_backward_add(&f, xrow, dy, in->rw[slot], dx, d_wg + e * per,
                                     d_wu + e * per, d_wd + e * per, buf);
    }
  }
  round_all(d_x, (size_t)L->T * L->H);
  round_all(d_wg, L->E_loc * per);
  round_all(d_wu, L->E_loc * per);
  round_all(d_wd, L->E_loc * per);
  if (L->I_s > 0) {
    round_all(d_sg, sper);
    round_all(d_su, sper);
    round_all(d_sd, sper);
  }
  weights_free(&w);
  free(buf);
}
