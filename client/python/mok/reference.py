# SPDX-License-Identifier: Apache-2.0
"""An independent float64 reference of the mok MoE layer (docs/design.md, "The layer").

Written from the math, not from any engine: numpy in float64, every
intermediate kept in float64, nothing rounded. The Python tests and
examples hold mokd's results against it with a relative-error bound. It
needs numpy only (not libmok), and bfloat16 inputs may be given as uint16
bit patterns (they are widened exactly).

Shapes (row-major, docs/math.md):
  x, out, d_out, d_x     [T,H]
  topk_ids, rw, d_rw     [T,K]   ids in [0,E) or -1 (dropped slot)
  w_gate, w_up           [E_loc,I,H]      w_down  [E_loc,H,I]
  s_gate, s_up           [I_s,H]          s_down  [H,I_s]
Slots whose id is -1 or outside [first_expert, first_expert+E_loc)
contribute nothing and get d_rw = 0. With swiglu_limit L the clamp
g' = min(g, L), u' = clamp(u, -L, L) applies to routed and shared experts;
its gradient passes where g <= L and where -L <= u <= L.

The clamp's gradient is a step function of g and u: an engine that stores
g and u in bfloat16 (docs/math.md: g = rnd(x·W_gᵀ), the mask is taken on
that) flips the mask wherever rounding carries g or |u| across L, and one
flipped element moves a whole weight-gradient row by O(1/sqrt(rows)). To
compare such an engine's gradients, pass clamp_masks="bfloat16": the masks
(only they) are then decided on g and u rounded to bfloat16; every value
stays float64.
"""
import numpy as np

from .bf16 import from_bf16, round_bf16

__all__ = ["forward", "backward", "rel_err", "flops"]

GRAD_NAMES = ("d_x", "d_router_weights", "d_w_gate", "d_w_up", "d_w_down",
              "d_s_gate", "d_s_up", "d_s_down")


def _f64(a):
    if a is None:
        return None
    a = np.asarray(a)
    if a.dtype == np.uint16 or a.dtype.name == "bfloat16":
        a = from_bf16(a)
    return a.astype(np.float64)


def _silu(v):
    return v / (1.0 + np.exp(-v))


def _sigmoid(v):
    return 1.0 / (1.0 + np.exp(-v))


def _ffn_fwd(xr, wg, wu, wd, limit):
    """rows xr [R,H] through one SwiGLU FFN; returns y and what backward needs."""
    g = xr @ wg.T
    u = xr @ wu.T
    if limit is not None:
        gc = np.minimum(g, limit)
        uc = np.clip(u, -limit, limit)
    else:
        gc, uc = g, u
    h = _silu(gc) * uc
    return h @ wd.T, (g, u, gc, uc, h)


def _ffn_bwd(xr, wg, wu, wd, dy, saved, limit, clamp_masks=None):
    """dy [R,H] is the gradient of y (router weight already applied)."""
    g, u, gc, uc, h = saved
    if limit is not None and clamp_masks is not None:
        if clamp_masks != "bfloat16":
            raise ValueError("clamp_masks must be None or \"bfloat16\"")
        g, u = round_bf16(g).astype(np.float64), round_bf16(u).astype(np.float64)
    dh = dy @ wd  # [R,I]
    s = _sigmoid(gc)
    dsilu = s * (1.0 + gc * (1.0 - s))
    dg = dh * uc * dsilu
    du = dh * _silu(gc)
    if limit is not None:
        dg = dg * (g <= limit)
        du = du * ((u >= -limit) & (u <= limit))
    d_wd = dy.T @ h
    d_wg = dg.T @ xr
    d_wu = du.T @ xr
    d_xr = dg @ wg + du @ wu
    return d_xr, d_wg, d_wu, d_wd


def _routed(topk_ids, n_local, first_expert):
    ids = np.asarray(topk_ids)
    if ids.dtype.kind not in "iu":
        raise TypeError("topk_ids must be integers")
    ids = ids.astype(np.int64)
    E_bad = (ids < -1)
    if E_bad.any():
        raise ValueError("topk_ids below -1")
    local = ids - first_expert
    return local, (ids >= 0) & (local >= 0) & (local < n_local)


def forward(x, topk_ids, router_weights, w_gate, w_up, w_down, s_gate=None, s_up=None,
            s_down=None, swiglu_limit=None, first_expert=0, return_parts=False):
    """out [T,H] float64 (and, with return_parts, the per-slot y [T,K,H])."""
    x, rw, wg, wu, wd = map(_f64, (x, router_weights, w_gate, w_up, w_down))
    T, H = x.shape
    K = rw.shape[1]
    E_loc = wg.shape[0]
    local, ok = _routed(topk_ids, E_loc, first_expert)
    y = np.zeros((T, K, H))
    for e in range(E_loc):
        t, k = np.nonzero(ok & (local == e))
        if len(t) == 0:
            continue
        y[t, k], _ = _ffn_fwd(x[t], wg[e], wu[e], wd[e], swiglu_limit)
    out = np.einsum("tk,tkh->th", rw * ok, y)
    if s_gate is not None:
        ys, _ = _ffn_fwd(x, _f64(s_gate), _f64(s_up), _f64(s_down), swiglu_limit)
        out = out + ys
    return (out, y) if return_parts else out


def backward(d_out, x, topk_ids, router_weights, w_gate, w_up, w_down, s_gate=None,
             s_up=None, s_down=None, swiglu_limit=None, first_expert=0, clamp_masks=None):
    """Every gradient of the layer, float64, as a dict keyed by GRAD_NAMES
    (d_s_* are None without a shared expert). clamp_masks: see the module doc."""
    x, rw, wg, wu, wd, d_out = map(_f64, (x, router_weights, w_gate, w_up, w_down, d_out))
    T, H = x.shape
    K = rw.shape[1]
    E_loc = wg.shape[0]
    local, ok = _routed(topk_ids, E_loc, first_expert)
    g = {"d_x": np.zeros((T, H)), "d_router_weights": np.zeros((T, K)),
         "d_w_gate": np.zeros_like(wg), "d_w_up": np.zeros_like(wu),
         "d_w_down": np.zeros_like(wd), "d_s_gate": None, "d_s_up": None, "d_s_down": None}
    for e in range(E_loc):
        t, k = np.nonzero(ok & (local == e))
        if len(t) == 0:
            continue
        xr = x[t]
        y, saved = _ffn_fwd(xr, wg[e], wu[e], wd[e], swiglu_limit)
        g["d_router_weights"][t, k] = np.sum(d_out[t] * y, axis=1)
        dy = rw[t, k][:, None] * d_out[t]
        d_xr, g["d_w_gate"][e], g["d_w_up"][e], g["d_w_down"][e] = _ffn_bwd(
            xr, wg[e], wu[e], wd[e], dy, saved, swiglu_limit, clamp_masks)
        np.add.at(g["d_x"], t, d_xr)
    if s_gate is not None:
        sg, su, sd = map(_f64, (s_gate, s_up, s_down))
        _, saved = _ffn_fwd(x, sg, su, sd, swiglu_limit)
        d_xs, g["d_s_gate"], g["d_s_up"], g["d_s_down"] = _ffn_bwd(
            x, sg, su, sd, d_out, saved, swiglu_limit, clamp_masks)
        g["d_x"] += d_xs
    return g


def rel_err(a, ref):
    """max |a - ref| / max |ref| (0 when both are all zeros); bf16 uint16 is widened."""
    a, ref = _f64(a), _f64(ref)
    if a.shape != ref.shape:
        raise ValueError("shape %s vs reference %s" % (a.shape, ref.shape))
    if a.size == 0:
        return 0.0
    diff = np.max(np.abs(a - ref))
    scale = np.max(np.abs(ref))
    if scale == 0.0:
        return float(diff) if diff else 0.0
    return float(diff / scale)


def flops(topk_ids, hidden, intermediate, shared_intermediate=0, n_experts=None,
          backward=True):
    """Useful GEMM flops of one forward (+ backward) pass: 6·H·I per routed row
    and 6·H·I_s per token forward; backward twice that (dgrad + wgrad)."""
    ids = np.asarray(topk_ids)
    rows = int(np.count_nonzero(ids >= 0 if n_experts is None else (ids >= 0) & (ids < n_experts)))
    T = ids.shape[0]
    fwd = 6.0 * hidden * (intermediate * rows + shared_intermediate * T)
    return fwd * (3.0 if backward else 1.0)
