# SPDX-License-Identifier: Apache-2.0
"""Standing jobs in Python (mok.h mok_standing_*; docs/cuda.md "Capture and replay").

layer.standing(op, T, tensors, flags=0) -> Standing: a forward or backward whose every
tensor is fixed (torch CUDA tensors named by data_ptr(), or numpy arrays in mokd's
shared memory from client.empty()). Standing.enqueue(stream) records the three
replay-invariant stream operations (capturable by a CUDA graph); trigger()/wait() run it
from the host (the cpu engine). check() raises the job's first failure (mok.Error).
"""
from ctypes import byref, c_void_p

from . import _lib
from ._errors import Error
from ._lib import OP, SLOT, TensorArray


def _raise(st):
    from ._client import _raise as r
    r(st)


class Standing:
    def __init__(self, layer, op, T, tensors, flags=0, hold=True):
        from ._client import _is_torch_cuda, _torch_dtype
        self.layer, self.op, self.tokens = layer, op, T
        # hold: the tensors must outlive the job, their addresses are in it. A CUDA graph's
        # own allocations need no holding (the graph's pool keeps their addresses for its
        # replays, as for its kernels' operands), and must not be held under
        # torch.compile's CUDA graph trees, which refuse pool memory that outlives a graph
        # unless it is one of the graph's outputs.
        self._hold = []
        arr = TensorArray()
        for slot, t in tensors.items():
            if t is None:
                continue
            code, shape = layer._expect(T, slot, op, flags)
            s = arr[SLOT[slot]]
            if _is_torch_cuda(t):
                if t.dtype != _torch_dtype(code) or tuple(t.shape) != shape or \
                        not t.is_contiguous():
                    raise Error("ESHAPE", "standing %s: %s must be a contiguous %s tensor of "
                                "shape %s, got %s %s" % (op, slot, _torch_dtype(code), shape,
                                                         t.dtype, tuple(t.shape)))
                s.data = t.data_ptr()
            else:
                if tuple(t.shape) != shape or not t.flags["C_CONTIGUOUS"]:
                    raise Error("ESHAPE", "standing %s: %s must be a contiguous array of shape "
                                "%s, got %s" % (op, slot, shape, tuple(t.shape)))
                s.data = t.ctypes.data
            s.dtype = code
            s.ndim = len(shape)
            for i, d in enumerate(shape):
                s.shape[i] = d
            if hold:
                self._hold.append(t)
        h = c_void_p()
        st = _lib.lib().mok_standing_create(layer._h(), OP[op], flags, T, arr, byref(h))
        if st:
            _raise(st)
        self._h = h.value
        layer.client._standing_jobs.add(self)

    def _handle(self):
        if not self._h:
            raise Error("ECLOSED", "this standing job is destroyed")
        return self._h

    def enqueue(self, stream):
        """Record one run on a CUDA stream (a CUstream handle, e.g.
        torch.cuda.current_stream().cuda_stream); capturable."""
        st = _lib.lib().mok_standing_enqueue(self._handle(), c_void_p(stream))
        if st:
            _raise(st)

    def trigger(self):
        st = _lib.lib().mok_standing_trigger(self._handle())
        if st:
            _raise(st)

    def wait(self, timeout_ms=-1):
        st = _lib.lib().mok_standing_wait(self._handle(), timeout_ms)
        if st:
            _raise(st)

    def check(self):
        """Raise the job's first failure, if any (after synchronising the stream)."""
        st = _lib.lib().mok_standing_status(self._handle())
        if st:
            _raise(st)

    @property
    def done(self):
        return int(_lib.lib().mok_standing_done(self._handle()))

    def close(self):
        h, self._h = self._h, None
        if h and not self.layer.client.closed:
            _lib.lib().mok_standing_destroy(h)
        self.layer.client._standing_jobs.discard(self)
        self._hold = []
