# SPDX-License-Identifier: Apache-2.0
"""mok.torch's cache of standing jobs (the jobs a CUDA graph capture records) and
check_graphs() on a machine without a GPU: the CUDA allocations are stood in for by a
table of buffer ids (what cuPointerGetAttribute(BUFFER_ID) answers for an address), the
layer and its standing jobs by fakes that count what is made, enqueued and closed.

- one job per (layer, op, T, flags, addresses): a second capture of the same tensors
  enqueues the same job again;
- a cached job is made anew when it was cancelled (a region re-registered), and when an
  address it names now holds another allocation (a deleted graph's pool freed and
  allocated again at the same address: mokd would still map the old one);
- check_graphs() closes, without an error, a job whose own outputs (allocated inside its
  capture) were freed, since its graph is gone; it raises the error of a job whose
  Parameter was reallocated while its outputs live (a live graph's replays did not run).
The real thing runs on the GPU in tests/gpu/test_graphs.py fp8. Skipped without torch or
without a build (run by tests/python/ci_torch.sh)."""
import os
import sys
import types
import weakref

import pytest

torch = pytest.importorskip("torch")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.path.join(REPO, os.environ.get("MOK_BUILD") or "build")
LIBMOK = os.path.join(BUILD, "lib", "libmok.so")
if not os.path.exists(LIBMOK):
    pytest.skip("not built: %s" % LIBMOK, allow_module_level=True)
sys.path.insert(0, os.path.join(REPO, "client", "python"))
os.environ.setdefault("MOK_LIBRARY", LIBMOK)
import mok  # noqa: E402
from mok import _torch_impl as ti  # noqa: E402


class FakeTensor:
    def __init__(self, ptr):
        self.ptr = ptr
        self.device = "cuda:0"

    def data_ptr(self):
        return self.ptr


class FakeStanding:
    def __init__(self, client):
        self.client, self._h, self.error, self.enqueued = client, 1, None, 0
        client._standing_jobs.add(self)

    def check(self):
        if not self._h:
            raise mok.Error("ECLOSED", "this standing job is destroyed")
        if self.error:
            raise mok.Error(*self.error)

    def enqueue(self, stream):
        self.enqueued += 1

    def close(self):
        self._h = None
        self.client._standing_jobs.discard(self)


class FakeClient:
    def __init__(self):
        self._standing_jobs = weakref.WeakSet()
        self.jobs = []  # every job made, in order (keeps them alive)

    def check_standing(self):
        for sj in list(self._standing_jobs):
            if sj._h:
                sj.check()


class FakeLayer:
    def __init__(self, client):
        self.client = client

    def standing(self, op, T, tensors, flags, hold):
        assert hold is False
        sj = FakeStanding(self.client)
        self.client.jobs.append(sj)
        return sj


@pytest.fixture
def world(monkeypatch):
    buffers = {}  # address -> buffer id (absent: not allocated)
    monkeypatch.setattr(ti, "_buffer_id", lambda t: buffers.get(
        t if isinstance(t, int) else t.data_ptr(), 0))
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: types.SimpleNamespace(cuda_stream=0))
    client = FakeClient()
    slot = types.SimpleNamespace(standing={})
    layer = FakeLayer(client)
    return types.SimpleNamespace(buffers=buffers, client=client, slot=slot, layer=layer)


def forward_tensors(w):
    """A forward's tensors: x and a weight (a Parameter) from outside the capture, out and
    ctx allocated by the op inside it."""
    for p, b in ((0x1000, 11), (0x2000, 12), (0x3000, 13), (0x4000, 13)):
        w.buffers.setdefault(p, b)
    return dict(x=FakeTensor(0x1000), w_gate=FakeTensor(0x2000), out=FakeTensor(0x3000),
                ctx=FakeTensor(0x4000))


def run(w, t):
    ti._standing_run(w.slot, w.layer, "forward", 256, t, 0, ("out", "ctx"))


def test_same_tensors_reuse_the_job(world):
    t = forward_tensors(world)
    run(world, t)
    run(world, t)
    assert len(world.client.jobs) == 1
    assert world.client.jobs[0].enqueued == 2


def test_other_addresses_make_another_job(world):
    t = forward_tensors(world)
    run(world, t)
    world.buffers[0x5000] = 14
    run(world, dict(t, out=FakeTensor(0x5000)))
    assert len(world.client.jobs) == 2
    assert world.client.jobs[0]._h and world.client.jobs[1]._h


def test_a_cancelled_job_is_made_anew(world):
    t = forward_tensors(world)
    run(world, t)
    first = world.client.jobs[0]
    first.error = ("ENOENT", "standing forward job: region 7 it names was unregistered")
    run(world, t)
    assert len(world.client.jobs) == 2
    assert first._h is None, "the cancelled job is closed"
    assert world.client.jobs[1].enqueued == 1


def test_a_job_on_freed_allocations_is_made_anew(world):
    t = forward_tensors(world)
    run(world, t)
    first = world.client.jobs[0]
    world.buffers[0x3000] = 99  # out's address now another allocation (no error seen yet)
    run(world, t)
    assert len(world.client.jobs) == 2 and first._h is None
    run(world, t)  # the new one is made on the new buffers: reused
    assert len(world.client.jobs) == 2 and world.client.jobs[1].enqueued == 2


def test_check_graphs_closes_the_job_of_a_deleted_graph(world):
    t = forward_tensors(world)
    run(world, t)
    job = world.client.jobs[0]
    del world.buffers[0x3000]  # the graph deleted, its pool freed
    world.buffers[0x4000] = 50  # and allocated again: mokd cancelled the job
    job.error = ("ENOENT", "standing forward job: region 9 it names was unregistered")
    ti.check_graphs(world.client)  # no error
    assert job._h is None
    assert not world.slot.standing, "the cache forgets it"
    run(world, forward_tensors(world))  # a new capture makes a new job
    assert len(world.client.jobs) == 2


def test_check_graphs_reports_a_live_graphs_reallocated_parameter(world):
    t = forward_tensors(world)
    run(world, t)
    job = world.client.jobs[0]
    world.buffers[0x2000] = 77  # w_gate reallocated; out and ctx (the graph's) still there
    job.error = ("ENOENT", "standing forward job: region 3 it names was unregistered")
    with pytest.raises(mok.Error) as e:
        ti.check_graphs(world.client)
    assert "ENOENT" in str(e.value)
    assert job._h, "still open: its graph lives"


def test_check_graphs_leaves_healthy_jobs(world):
    t = forward_tensors(world)
    run(world, t)
    ti.check_graphs(world.client)
    assert world.client.jobs[0]._h
    run(world, t)
    assert world.client.jobs[0].enqueued == 2
