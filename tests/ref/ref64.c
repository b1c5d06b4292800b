/* SPDX-License-Identifier: Apache-2.0 */
/* ref64: float64 reference of the MoE layer, straight from docs/design.md ("The layer").
 *
 * Deliberately naive: one (token, slot) at a time, every value in double,
 * no blocking, no rounding. Independent of the engines' code. */
#include "ref64.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static double sigmoid64(double v) { return 1.0 / (1.0 + exp(-v)); }
static double silu64(double v) { return v * sigmoid64(v); }
static double dsilu64(double v) {
  double s = sigmoid64(v);
  return s * (1.0 + v * (1.0 - s));
}

/* One SwiGLU FFN with weights wg/wu [n,H], wd [H,n] applied to one row. */
typedef struct ffn64 {
  int H, n;
  const double *wg, *wu, *wd;
  int has_limit;
  double limit;
} ffn64;

/* Fills pre-clamp g, u and h = silu(g')*u' for one input row. */
static void ffn64_hidden(const ffn64 *f, const double *xrow, double *g, double *u, double *h) {
  for (int i = 0; i < f->n; i++) {
    double sg = 0.0, su = 0.0;
    for (int c = 0; c < f->H; c++) {
      sg += xrow[c] * f->wg[(size_t)i * f->H + c];
      su += xrow[c] * f->wu[(size_t)i * f->H + c];
    }
    g[i] = sg;
    u[i] = su;
    double gc = sg, uc = su;
    if (f->has_limit) {
      if (gc > f->limit) gc = f->limit;
      if (uc > f->limit) uc = f->limit;
      if (uc < -f->limit) uc = -f->limit;
    }
    h[i] = silu64(gc) * uc;
  }
}

/* acc[j] += scale * Σ_i h[i] wd[j,i] */
static void ffn64_down_add(const ffn64 *f, const double *h, double scale, double *acc) {
  for (int j = 0; j < f->H; j++) {
    double s = 0.0;
    for (int i = 0; i < f->n; i++) s += h[i] * f->wd[(size_t)j * f->n + i];
    acc[j] += scale * s;
  }
}

/* Backward of scale * FFN(xrow) given d_out row dy. Adds into dx, dwg, dwu,
 * dwd; returns <W_d^T dy, h> (the gradient of the scale). */
static double ffn64_backward_add(const ffn64 *f, const double *xrow, const double *dy, double scale,
                                 double *dx, double *dwg, double *dwu, double *dwd,
                                 double *g, double *u, double *h) {
  ffn64_hidden(f, xrow, g, u, h);
  double d_scale = 0.0;
  for (int i = 0; i < f->n; i++) {
    double a = 0.0;
    for (int j = 0; j < f->H; j++) a += dy[j] * f->wd[(size_t)j * f->n + i];
    d_scale += a * h[i];
    double dh = scale * a;
    double gc = g[i], uc = u[i];
    double pass_g = 1.0, pass_u = 1.0;
    if (f->has_limit) {
      if (g[i] > f->limit) { gc = f->limit; pass_g = 0.0; }
      if (u[i] > f->limit) { uc = f->limit; pass_u = 0.0; }
      if (u[i] < -f->limit) { uc = -f->limit; pass_u = 0.0; }
    }
    double dg = dh * uc * dsilu64(gc) * pass_g;
    double du = dh * silu64(gc) * pass_u;
    for (int c = 0; c < f->H; c++) {
      dx[c] += dg * f->wg[(size_t)i * f->H + c] + du * f->wu[(size_t)i * f->H + c];
      dwg[(size_t)i * f->H + c] += dg * xrow[c];
      dwu[(size_t)i * f->H + c] += du * xrow[c];
    }
  }
  for (int j = 0; j < f->H; j++)
    for (int i = 0; i < f->n; i++) dwd[(size_t)j * f->n + i] += scale * dy[j] * h[i];
  return d_scale;
}

static ffn64 routed_ffn(const ref64_layer *L, const ref64_inputs *in, int e) {
  size_t per = (size_t)L->I * L->H;
  ffn64 f = {L->H, L->I, in->wg + e * per, in->wu + e * per, in->wd + e * per, L->has_limit,
             L->limit};
  return f;
}

static ffn64 shared_ffn(const ref64_layer *L, const ref64_inputs *in) {
  ffn64 f = {L->H, L->I_s, in->sg, in->su, in->sd, L->has_limit, L->limit};
  return f;
}

/* Local expert index of slot (t,k), or -1 when dropped / not local. */
static int local_expert(const ref64_layer *L, const ref64_inputs *in, int t, int k) {
  int32_t id = in->ids[(size_t)t * L->K + k];
  if (id < L->first_expert || id >= L->first_expert + L->E_loc) return -1;
  return id - L->first_expert;
}

static int max_int(int a, int b) { return a > b ? a : b; }

void ref64_forward(const ref64_layer *L, const ref64_inputs *in, double *out) {
  int n = max_int(max_int(L->I, L->I_s), 1);
  double *g = malloc(sizeof(double) * n), *u = malloc(sizeof(double) * n),
         *h = malloc(sizeof(double) * n);
  if (!g || !u || !h) abort();
  for (int t = 0; t < L->T; t++) {
    const double *xrow = in->x + (size_t)t * L->H;
    double *orow = out + (size_t)t * L->H;
    memset(orow, 0, sizeof(double) * L->H);
    if (L->I_s > 0) {
      ffn64 f = shared_ffn(L, in);
      ffn64_hidden(&f, xrow, g, u, h);
      ffn64_down_add(&f, h, 1.0, orow);
    }
    for (int k = 0; k < L->K; k++) {
      int e = local_expert(L, in, t, k);
      if (e < 0) continue;
      ffn64 f = routed_ffn(L, in, e);
      ffn64_hidden(&f, xrow, g, u, h);
      ffn64_down_add(&f, h, in->rw[(size_t)t * L->K + k], orow);
    }
  }
  free(g);
  free(u);
  free(h);
}

void ref64_backward(const ref64_layer *L, const ref64_inputs *in, const double *d_out,
                    double *d_x, double *d_rw, double *d_wg, double *d_wu, double *d_wd,
                    double *d_sg, double *d_su, double *d_sd) {
  size_t per = (size_t)L->I * L->H;
  memset(d_x, 0, sizeof(double) * L->T * L->H);
  memset(d_rw, 0, sizeof(double) * L->T * L->K);
  memset(d_wg, 0, sizeof(double) * L->E_loc * per);
  memset(d_wu, 0, sizeof(double) * L->E_loc * per);
  memset(d_wd, 0, sizeof(double) * L->E_loc * per);
  size_t sper = (size_t)L->I_s * L->H;
  if (L->I_s > 0) {
    memset(d_sg, 0, sizeof(double) * sper);
    memset(d_su, 0, sizeof(double) * sper);
    memset(d_sd, 0, sizeof(double) * sper);
  }
  int n = max_int(max_int(L->I, L->I_s), 1);
  double *g = malloc(sizeof(double) * n), *u = malloc(sizeof(double) * n),
         *h = malloc(sizeof(double) * n);
  if (!g || !u || !h) abort();
  for (int t = 0; t < L->T; t++) {
    const double *xrow = in->x + (size_t)t * L->H;
    const double *dy = d_out + (size_t)t * L->H;
    double *dx = d_x + (size_t)t * L->H;
    if (L->I_s > 0) {
      ffn64 f = shared_ffn(L, in);
      ffn64_backward_add(&f, xrow, dy, 1.0, dx, d_sg, d_su, d_sd, g, u, h);
    }
    for (int k = 0; k < L->K; k++) {
      int e = local_expert(L, in, t, k);
      if (e < 0) continue;
      ffn64 f = routed_ffn(L, in, e);
      size_t slot = (size_t)t * L->K + k;
      d_rw[slot] = ffn64_backward_add(&f, xrow, dy, in->rw[slot], dx, d_wg + e * per,
                                      d_wu + e * per, d_wd + e * per, g, u, h);
    }
  }
  free(g);
  free(u);
  free(h);
}

double ref64_rel_err(const double *ref, const double *got, size_t n) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < n; i++) {
    if (!isfinite(ref[i]) || !isfinite(got[i])) return INFINITY;
    double d = got[i] - ref[i];
    num += d * d;
    den += ref[i] * ref[i];
  }
  if (den < 1e-300) den = 1e-300;
  return sqrt(num) / sqrt(den);
}
