# SPDX-License-Identifier: Apache-2.0
"""mok.distributed: expert-parallel groups formed from a torch.distributed process group.

    import torch.distributed as dist, mok, mok.distributed
    dist.init_process_group("nccl")                        # or "gloo"
    c = mok.connect("/run/mok/mokd-%d.sock" % local_rank)  # this rank's own mokd
    g = mok.distributed.join(c, dist.group.WORLD, max_tokens=T_max, hidden=H, topk=K,
                             experts=E, dtype="bfloat16")
    layer = c.layer(hidden=H, intermediate=I, experts=E, topk=K, group=g)

join() is collective over the process group (every member calls it, like
deep_ep.Buffer(group)): it finds this process's rank and the world size in the
group, checks that every rank asks for the same sizing, lets the group's rank 0
make the group's key (a fresh unique key; on the cuda engine with one rank per
GPU also an NCCL id from rank 0's mokd), hands it to every rank with
broadcast_object_list, joins on every rank, and then lets the ranks agree on
success through the c10d store within a timeout: either every rank returns its
mok.Group, or every rank raises mok.Error (a member that failed, or one that
never reported, is named). Works with the numpy Client on the cpu engine too.
Importing this module never imports torch. docs/torch.md, "Groups from
torch.distributed", has the rules.
"""
import datetime
import json
import os
import re
import socket
import uuid

from ._client import Group, _dtype_code
from ._errors import Error
from . import _lib

__all__ = ["join", "plan"]

_BUS = re.compile(r"^[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-9a-fA-F]$")
_TRANSPORTS = ("auto", "host", "nccl")


def _dist():
    try:
        import torch.distributed as dist
    except ImportError as e:
        raise ImportError("mok.distributed needs PyTorch (import torch.distributed failed: "
                          "%s); the rest of the mok package works without it" % e) from e
    return dist


def _host_id():
    """This machine: host name and boot id (two containers of one name differ)."""
    boot = ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        pass
    return "%s/%s" % (socket.gethostname(), boot)


def _gpu_id(client):
    """The GPU of the client's mokd: the PCI bus id the cuda engine ends its
    description with, else the whole description."""
    dev = client.device or ""
    last = dev.split()[-1] if dev.split() else ""
    return last.lower() if _BUS.match(last) else dev


def _sizing(max_tokens, hidden, topk, experts, dtype, capacity, ring_rows):
    try:
        code = _dtype_code(dtype)
    except Error:
        code = repr(dtype)
    dname = {_lib.DTYPE_F32: "float32", _lib.DTYPE_BF16: "bfloat16"}.get(code, code)
    return {"max_tokens": max_tokens, "hidden": hidden, "topk": topk, "experts": experts,
            "dtype": dname, "capacity": capacity, "ring_rows": ring_rows}


def plan(infos, transport="auto"):
    """The verdict every rank reaches from every rank's info (pure; tested on its own):
    (transport, None) or (None, (status, message)). infos[r]: dict with sizing, engine,
    host, gpu and error (a local failure or None)."""
    world = len(infos)
    bad = [(r, i["error"]) for r, i in enumerate(infos) if i.get("error")]
    if bad:
        return None, (bad[0][1][0], "; ".join("rank %d: %s" % (r, e[1]) for r, e in bad))
    s0 = infos[0]["sizing"]
    for field in s0:
        vals = [i["sizing"].get(field) for i in infos]
        if any(v != vals[0] for v in vals):
            return None, ("EINVAL", "ranks disagree on the group's %s: %s" % (
                field, ", ".join("rank %d has %r" % (r, v) for r, v in enumerate(vals))))
    wants = sorted(set(i["transport"] for i in infos))
    if len(wants) > 1:
        return None, ("EINVAL", "ranks disagree on transport: %s" % ", ".join(
            "rank %d asks %r" % (r, i["transport"]) for r, i in enumerate(infos)))
    engines = [i["engine"] for i in infos]
    if any(e != engines[0] for e in engines):
        return None, ("EINVAL", "ranks' mokds run different engines: %s" % ", ".join(
            "rank %d %s" % (r, e) for r, e in enumerate(engines)))
    hosts = [i["host"] for i in infos]
    one_host = all(h == hosts[0] for h in hosts)
    gpus = [(i["host"], i["gpu"]) for i in infos]
    shared = [(a, b) for a in range(world) for b in range(a + 1, world) if gpus[a] == gpus[b]]
    if transport == "auto":
        transport = "nccl" if engines[0] == "cuda" and not shared else "host"
    if transport == "nccl":
        if engines[0] != "cuda":
            return None, ("EUNSUPPORTED", "groups through NCCL need the cuda engine (the ranks' "
                          "mokds run the %s engine)" % engines[0])
        if shared:
            a, b = shared[0]
            return None, ("EUNSUPPORTED", "ranks %d and %d are served by one GPU (%s); NCCL "
                          "puts one rank on one GPU: use transport='host' (one host)" %
                          (a, b, gpus[a][1]))
    elif not one_host:
        far = [r for r in range(world) if hosts[r] != hosts[0]]
        return None, ("EUNSUPPORTED", "a host group needs every rank's mokd on one host; "
                      "rank%s %s run%s on another host than rank 0%s" % (
                          "s" if len(far) > 1 else "", ", ".join(map(str, far)),
                          "" if len(far) > 1 else "s",
                          "" if engines[0] != "cuda" or shared else
                          " (transport='nccl' forms a group across one NVLink domain)"))
    return transport, None


def _store():
    """The default process group's c10d store (for the agreement's timeout), or None."""
    try:
        from torch.distributed import distributed_c10d as c10d
        return c10d._get_default_store()
    except Exception:  # an older or newer torch without it: fall back to a collective
        return None


def _agree(dist, pg, store, tag, rank, world, mine, timeout_s):
    """Every rank's join outcome, or raise ETIMEOUT naming the ranks that never reported."""
    if store is None:
        out = [None] * world
        dist.all_gather_object(out, mine, group=pg)
        return out
    keys = ["mok-join/%s/%d" % (tag, r) for r in range(world)]
    store.set(keys[rank], json.dumps(mine))
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except Exception:
        missing = [r for r in range(world) if not store.check([keys[r]])]
        raise Error("ETIMEOUT", "mok.distributed.join: rank%s %s did not report %s join "
                    "within %g s (crashed, stalled, or not calling join)" % (
                        "s" if len(missing) != 1 else "", ", ".join(map(str, missing)) or "?",
                        "their" if len(missing) != 1 else "its", timeout_s))
    return [json.loads(store.get(k)) for k in keys]


def _leave(g):
    if g is not None:
        try:
            g.leave()
        except Error:
            pass  # the join's failure is what the caller must see


def join(client, group=None, *, max_tokens, hidden, topk, experts, dtype="float32",
         timeout_ms=0, capacity=0.0, ring_rows=0, transport="auto", key_prefix="torch",
         agree_timeout_s=None):
    """Join this rank of an expert-parallel group whose members are the ranks of
    `group` (a torch.distributed ProcessGroup; None: the default group), each through
    its own mokd (`client`). Collective: every member calls it with the same sizing
    (max_tokens, hidden, topk, experts, dtype, capacity, ring_rows; see Client.group).

    transport: "auto" (NCCL on the cuda engine when every rank has a GPU of its own,
    else a host group), "host" (every mokd on one host; the cpu engine's only kind)
    or "nccl" (the cuda engine, one rank per GPU of one NVLink domain).
    agree_timeout_s: how long ranks wait for each other's outcome after joining
    (default: the group timeout plus 30 s; 60 s when timeout_ms is 0).
    Returns the mok.Group (with .process_group and .transport set); on any rank's
    failure every rank raises mok.Error naming the ranks that failed and why."""
    dist = _dist()
    if not dist.is_available() or not dist.is_initialized():
        raise Error("EINVAL", "mok.distributed.join: torch.distributed is not initialised "
                    "(call torch.distributed.init_process_group first)")
    pg = dist.group.WORLD if group is None else group
    rank = dist.get_rank(pg)
    if rank < 0:
        raise Error("EINVAL", "mok.distributed.join: this process is not a member of the "
                    "process group")
    world = dist.get_world_size(pg)
    src = dist.get_global_rank(pg, 0)
    if transport not in _TRANSPORTS:
        raise Error("EINVAL", "transport must be one of %s, got %r" % (
            ", ".join(_TRANSPORTS), transport))
    if agree_timeout_s is None:
        agree_timeout_s = (timeout_ms / 1000.0 if timeout_ms else 30.0) + 30.0

    # 1. every rank's sizing and whereabouts; a local failure travels instead of raising,
    #    so that no rank is left alone in a collective
    info = {"sizing": _sizing(max_tokens, hidden, topk, experts, dtype, capacity, ring_rows),
            "transport": transport, "engine": None, "host": _host_id(), "gpu": None,
            "error": None}
    try:
        if client.closed:
            raise Error("ECLOSED", "this rank's mok client is closed")
        info["engine"], info["gpu"] = client.engine, _gpu_id(client)
    except Error as e:
        info["error"] = (e.status, e.message)
    except Exception as e:  # not a mok.Client
        info["error"] = ("EINVAL", "client: %s" % e)
    infos = [None] * world
    dist.all_gather_object(infos, info, group=pg)
    chosen, err = plan(infos, transport)
    if err:
        raise Error(err[0], "mok.distributed.join: %s" % err[1])

    # 2. rank 0 makes the key (and the NCCL id) and hands it to every rank
    payload = [None]
    if rank == 0:
        tag = uuid.uuid4().hex
        made = {"key": "%s/%s" % (key_prefix, tag), "tag": tag, "nccl_id": None,
                "error": None}
        if chosen == "nccl":
            try:
                made["nccl_id"] = client.nccl_id()
            except Error as e:
                made["error"] = (e.status, e.message)
        payload = [made]
    dist.broadcast_object_list(payload, src=src, group=pg)
    made = payload[0]
    if made["error"]:
        raise Error(made["error"][0], "mok.distributed.join: rank 0 could not make the "
                    "group's NCCL id: %s" % made["error"][1])

    # 3. join, then agree: all ranks succeed or all raise
    g, mine = None, {"ok": True, "status": "OK", "message": "", "pid": os.getpid()}
    try:
        g = Group(client, made["key"], rank, world, max_tokens, hidden, topk, experts, dtype,
                  timeout_ms, capacity, ring_rows, made["nccl_id"])
    except Error as e:
        mine.update(ok=False, status=e.status, message=e.message)
    except Exception as e:
        mine.update(ok=False, status="EINVAL", message="%s: %s" % (type(e).__name__, e))
    try:
        outs = _agree(dist, pg, _store(), made["tag"], rank, world, mine, agree_timeout_s)
    except BaseException:
        _leave(g)
        raise
    failed = [(r, o) for r, o in enumerate(outs) if not o["ok"]]
    if failed:
        _leave(g)
        raise Error(failed[0][1]["status"], "mok.distributed.join: %s" % "; ".join(
            "rank %d failed to join: %s %s" % (r, o["status"], o["message"]) for r, o in failed))
    g.process_group = pg
    g.transport = chosen
    return g
