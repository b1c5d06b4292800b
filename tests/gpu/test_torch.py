# SPDX-License-Identifier: Apache-2.0
"""The Python binding with torch CUDA tensors on mokd --engine cuda (device only).

Runs one layer through numpy (host memory, staged) and through torch CUDA
tensors (zero copy, on the current stream, no host wait) and checks that
both give the same bits, that no output is NaN, and that a torch stream
sees the results in order. $MOK_SOCKET names a cuda-engine mokd.
"""
import sys

import numpy as np
import torch

import mok


def main():
    torch.manual_seed(0)
    rng = np.random.default_rng(1)
    T, H, I, E, K, Is = 133, 256, 128, 8, 2, 64
    c = mok.connect()
    assert c.engine == "cuda", c.engine
    layer = c.layer(hidden=H, intermediate=I, experts=E, topk=K, shared_intermediate=Is,
                    dtype="bfloat16", max_tokens=256)
    dev = torch.device("cuda")

    def bf(shape, scale):
        return (torch.rand(shape, device=dev) * 2 - 1).mul(scale).to(torch.bfloat16)

    x, d_out = bf((T, H), 1.0), bf((T, H), 1.0)
    wg, wu = bf((E, I, H), 4 / H ** 0.5), bf((E, I, H), 4 / H ** 0.5)
    wd = bf((E, H, I), 3 / I ** 0.5)
    sg, su, sd = bf((Is, H), 4 / H ** 0.5), bf((Is, H), 4 / H ** 0.5), bf((H, Is), 3 / Is ** 0.5)
    ids = torch.stack([torch.randperm(E, device=dev)[:K] for _ in range(T)]).to(torch.int32)
    ids[::7, 1] = -1
    rw = torch.rand((T, K), device=dev, dtype=torch.float32)

    # torch path: no host wait between the jobs and the stream's own work
    out, ctx = layer.forward(x, ids, rw, wg, wu, wd, sg, su, sd)
    out2 = out.float() * 2  # a torch op on the same stream, after the job
    grads = layer.backward(ctx, d_out)
    c.synchronize()
    torch.cuda.synchronize()

    def np16(t):
        return t.contiguous().view(torch.int16).cpu().numpy().view(np.uint16)

    def bits(a):  # bf16 results come back as ml_dtypes.bfloat16 where it is installed
        return a.view(np.uint16) if a.dtype.itemsize == 2 else a

    # numpy path, same bits in host memory
    out_np, ctx_np = layer.forward(np16(x), ids.cpu().numpy(), rw.cpu().numpy(), np16(wg),
                                   np16(wu), np16(wd), np16(sg), np16(su), np16(sd))
    g_np = layer.backward(ctx_np, np16(d_out))
    fails = 0
    if not np.array_equal(np16(out), bits(out_np)):
        print("FAIL out differs between torch and numpy paths"); fails += 1
    if not torch.equal(out2, out.float() * 2):
        print("FAIL the stream op after forward saw other values"); fails += 1
    for name in mok.Grads._fields:
        a, b = getattr(grads, name), getattr(g_np, name)
        a = a.cpu().numpy() if a.dtype == torch.float32 else np16(a)
        if not np.array_equal(a, bits(b)):
            print("FAIL %s differs between torch and numpy paths" % name); fails += 1
        if a.dtype == np.float32 and not np.isfinite(a).all():
            print("FAIL %s not finite" % name); fails += 1
    # recompute mode on torch
    out_r, ctx_r = layer.forward(x, ids, rw, wg, wu, wd, sg, su, sd, recompute=True)
    g_r = layer.backward(ctx_r, d_out)
    c.synchronize()
    if not all(torch.equal(getattr(g_r, n), getattr(grads, n)) for n in mok.Grads._fields):
        print("FAIL recompute backward differs"); fails += 1
    # a bad routing id: reported by the next call / synchronize
    bad = ids.clone()
    bad[3, 0] = E + 5
    layer.forward(x, bad, rw, wg, wu, wd, sg, su, sd)
    try:
        c.synchronize()
        print("FAIL a bad routing id was not reported"); fails += 1
    except mok.Error as e:
        print("bad routing id -> %s" % e)
    c.close()
    print("test_torch: %s (%d failures)" % ("passed" if not fails else "FAILED", fails))
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
