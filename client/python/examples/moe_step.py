#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""A few training steps of one MoE layer on mokd, checked against float64.

    build/bin/mokd --socket /tmp/mok.sock --engine cpu &
    MOK_SOCKET=/tmp/mok.sock python3 client/python/examples/moe_step.py

Connects (start-up check), creates a layer of a realistic small shape
(T=256, H=512, I=256, E=16, K=4, shared I_s=256; bfloat16 on a GPU engine,
float32 on the cpu engine), keeps the weights in daemon-shared memory
(c.empty: no copies), runs forward + backward a few times on fresh tokens,
holds every result against mok.reference (the float64 numpy reference the
tests use) and prints a summary. Exit status: 0 all good, 1 a result is off,
2 no daemon / no libmok.
"""
import argparse
import os
import sys
import time

import numpy as np

try:
    import mok
except ImportError:  # run from the source tree
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import mok
from mok import reference

TOL = {"float32": 1e-5, "bfloat16": 1e-2}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--socket", help="mokd's socket (default: $MOK_SOCKET, /run/mok/mokd-0.sock)")
    p.add_argument("--tokens", "-T", type=int, default=256)
    p.add_argument("--hidden", "-H", type=int, default=512)
    p.add_argument("--intermediate", "-I", type=int, default=256)
    p.add_argument("--experts", "-E", type=int, default=16)
    p.add_argument("--topk", "-K", type=int, default=4)
    p.add_argument("--shared", type=int, default=256, help="shared expert's I_s (0: none)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"],
                   help="default: bfloat16 on a GPU engine, float32 on the cpu engine")
    p.add_argument("--swiglu-limit", type=float, default=None)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--tol", type=float, help="max relative error (default 1e-5 f32, 1e-2 bf16)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    T, H, I, E, K, I_s = (args.tokens, args.hidden, args.intermediate, args.experts, args.topk,
                          args.shared)

    # ---- start-up check ----
    try:
        c = mok.connect(args.socket, name="moe_step.py")
    except mok.Error as e:
        print("moe_step: cannot start: %s" % e, file=sys.stderr)
        return 2
    with c:
        dtype = args.dtype or ("float32" if c.engine == "cpu" else "bfloat16")
        tol = args.tol if args.tol is not None else TOL[dtype]
        print("mokd: engine %s, device %s, session %d (libmok %s)" % (
            c.engine, c.device, c.session, mok.library_path()))
        print("ring round trip: %.1f us" % (1e6 * min(c.nop() for _ in range(20))))
        try:
            layer = c.layer(hidden=H, intermediate=I, experts=E, topk=K, shared_intermediate=I_s,
                            dtype=dtype, swiglu_limit=args.swiglu_limit, max_tokens=T)
        except mok.Error as e:
            print("moe_step: cannot create the layer: %s" % e, file=sys.stderr)
            return 2
        print("layer: T=%d H=%d I=%d E=%d K=%d I_s=%d %s%s" % (
            T, H, I, E, K, I_s, dtype,
            "" if args.swiglu_limit is None else " swiglu_limit=%g" % args.swiglu_limit))

        conv = mok.to_bf16 if dtype == "bfloat16" else (lambda a: a.astype(np.float32))
        rng = np.random.default_rng(args.seed)

        def shared_param(shape, fan_in):
            a = c.empty(shape, dtype)  # daemon-shared: weights travel without copies
            a[...] = conv(rng.standard_normal(shape) / np.sqrt(fan_in))
            return a

        w = dict(w_gate=shared_param((E, I, H), H), w_up=shared_param((E, I, H), H),
                 w_down=shared_param((E, H, I), I))
        if I_s:
            w.update(s_gate=shared_param((I_s, H), H), s_up=shared_param((I_s, H), H),
                     s_down=shared_param((H, I_s), I_s))

        worst = {}
        times = []
        flops = 0.0
        for step in range(args.steps):
            x = conv(rng.standard_normal((T, H)))
            logits = rng.standard_normal((T, E))
            ids = np.argsort(-logits, axis=1)[:, :K].astype(np.int32)
            top = np.take_along_axis(logits, ids, axis=1)
            rw = (np.exp(top) / np.exp(top).sum(axis=1, keepdims=True)).astype(np.float32)
            d_out = conv(rng.standard_normal((T, H)))
            shared = {k: w[k] for k in ("s_gate", "s_up", "s_down") if k in w}

            t0 = time.perf_counter()
            out, ctx = layer.forward(x, ids, rw, w["w_gate"], w["w_up"], w["w_down"], **shared)
            grads = layer.backward(ctx, d_out)
            times.append(time.perf_counter() - t0)
            flops = reference.flops(ids, H, I, I_s)

            ins = dict(x=x, topk_ids=ids, router_weights=rw, **w)
            r_out = reference.forward(swiglu_limit=args.swiglu_limit, **ins)
            # bf16 engines decide the clamp masks on bf16-rounded g, u: so does the reference
            r_g = reference.backward(d_out, swiglu_limit=args.swiglu_limit, clamp_masks=(
                "bfloat16" if dtype == "bfloat16" else None), **ins)
            errs = {"out": reference.rel_err(out, r_out)}
            for n in mok.Grads._fields:
                if r_g[n] is not None:
                    errs[n] = reference.rel_err(getattr(grads, n), r_g[n])
            for k, v in errs.items():
                worst[k] = max(worst.get(k, 0.0), v)

        print("max relative error vs float64 over %d steps (tolerance %g):" % (args.steps, tol))
        bad = []
        for k, v in worst.items():
            ok = v < tol
            bad += [] if ok else [k]
            print("  %-18s %.3e%s" % (k, v, "" if ok else "  MISMATCH"))
        best = min(times)
        med = sorted(times)[len(times) // 2]
        print("forward+backward: %.2f ms/step (median; best %.2f ms), %.1f GFLOP/s" % (
            1e3 * med, 1e3 * best, flops / med / 1e9))
        if bad:
            print("moe_step: FAILED: %s off the reference" % ", ".join(bad), file=sys.stderr)
            return 1
        print("moe_step: OK")
        return 0


if __name__ == "__main__":
    sys.exit(main())
