# SPDX-License-Identifier: Apache-2.0
"""mokd's /metrics endpoint read by the real Prometheus parser
(prometheus_client.parser.text_string_to_metric_families), docs/metrics.md.

A mokd on the cpu engine with the endpoint on a free loopback port runs
jobs for clients of several names (one job fails); the scrape must parse,
every family must be a counter, gauge or histogram with its HELP, every
histogram consistent (buckets cumulative by le, +Inf equal to _count),
labels of bounded cardinality (never a session, at most
metrics-max-label-sets tenants plus "other"), and the counts right.

Skipped when prometheus_client is not installed (tests/python/ci_metrics.sh
OUTDIR makes a venv with it and runs this file). $MOK_BUILD names the build.
"""
import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

parser = pytest.importorskip("prometheus_client.parser")
np = pytest.importorskip("numpy")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.path.join(REPO, os.environ.get("MOK_BUILD") or "build")
LIBMOK = os.path.join(BUILD, "lib", "libmok.so")
MOKD = os.path.join(BUILD, "bin", "mokd")
if not (os.path.exists(LIBMOK) and os.path.exists(MOKD)):
    pytest.skip("not built: %s, %s" % (LIBMOK, MOKD), allow_module_level=True)
sys.path.insert(0, os.path.join(REPO, "client", "python"))
os.environ.setdefault("MOK_LIBRARY", LIBMOK)
import mok  # noqa: E402

MAX_LABEL_SETS = 2
OPS = {"nop", "forward", "backward", "dispatch", "compute", "combine", "combine_backward",
       "compute_backward", "dispatch_backward", "quantize_weight", "unknown"}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mokd(tmp_path_factory):
    d = tmp_path_factory.mktemp("mokd-metrics")
    sock = str(d / "mokd.sock")
    for _ in range(10):  # the port may be taken between our look and mokd's bind
        port = free_port()
        conf = d / "mokd.conf"
        conf.write_text("metrics-listen = 127.0.0.1:%d\nmetrics-per-uid = yes\n"
                        "metrics-max-label-sets = %d\n" % (port, MAX_LABEL_SETS))
        log = open(str(d / "mokd.log"), "w+")
        proc = subprocess.Popen([MOKD, "--socket", sock, "--engine", "cpu", "--threads", "2",
                                 "--config", str(conf)], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.time() + 15
        while not os.path.exists(sock) and proc.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        if os.path.exists(sock):
            break
        proc.kill()
        proc.wait()
        log.seek(0)
        text = log.read()
        assert "cannot listen there" in text, "mokd did not come up:\n" + text
    yield sock, port
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=15) == 0


def scrape(port):
    with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
        return r.read().decode("utf-8")


def families(text):
    return {f.name: f for f in parser.text_string_to_metric_families(text)}


def value(fams, family, sample_name, **labels):
    for s in fams[family].samples:
        if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    return None


def run_jobs(sock):
    """Forwards for clients of four names (two more than the label sets),
    nops, and one forward that fails (an expert id past E)."""
    T, H, I, E, K = 8, 32, 16, 4, 2
    rng = np.random.default_rng(5)
    a = dict(x=rng.standard_normal((T, H)).astype(np.float32),
             topk_ids=np.argsort(rng.random((T, E)), axis=1)[:, :K].astype(np.int32),
             router_weights=rng.random((T, K)).astype(np.float32),
             w_gate=(rng.standard_normal((E, I, H)) / 6).astype(np.float32),
             w_up=(rng.standard_normal((E, I, H)) / 6).astype(np.float32),
             w_down=(rng.standard_normal((E, H, I)) / 4).astype(np.float32))
    names = ["prom-a", "prom-b", "prom-c", "prom-d"]
    clients = [mok.connect(sock, name=n) for n in names]  # all live: c and d are "other"
    try:
        for i, c in enumerate(clients):
            layer = c.layer(hidden=H, intermediate=I, experts=E, topk=K)
            for _ in range(i + 1):
                layer.forward(a["x"], a["topk_ids"], a["router_weights"], a["w_gate"],
                              a["w_up"], a["w_down"])
            c.nop()
        bad = a["topk_ids"].copy()
        bad[0, 0] = E
        with pytest.raises(mok.Error):
            layer.forward(a["x"], bad, a["router_weights"], a["w_gate"], a["w_up"], a["w_down"])
        return names
    finally:
        for c in clients:
            c.close()


def test_the_scrape_parses_and_counts(mokd):
    sock, port = mokd
    before = families(scrape(port))  # the daemon is shared: counts are deltas
    names = run_jobs(sock)
    text = scrape(port)
    fams = families(text)

    def grew(family, sample_name, **labels):
        return value(fams, family, sample_name, **labels) - \
            (value(before, family, sample_name, **labels) or 0)

    # every family typed, described, and named as Prometheus expects
    for f in fams.values():
        assert f.type in ("counter", "gauge", "histogram"), (f.name, f.type)
        assert f.documentation, f.name
        assert f.name.startswith("mokd_"), f.name
        for s in f.samples:
            if f.type == "counter":
                assert s.name in (f.name + "_total", f.name + "_created"), s.name
                assert s.value >= 0 and s.value == int(s.value), s
    for line in text.splitlines():
        if line.startswith("# TYPE ") and line.split()[3] == "counter":
            assert line.split()[2].endswith("_total"), line
    # the jobs: 1+2+3+4 forwards, 4 nops, 1 forward failed
    assert grew("mokd_jobs_completed", "mokd_jobs_completed_total", op="forward") == 10
    assert grew("mokd_jobs_completed", "mokd_jobs_completed_total", op="nop") == 4
    assert grew("mokd_jobs_failed", "mokd_jobs_failed_total", op="forward", status="EROUTE") == 1
    assert grew("mokd_sessions_opened", "mokd_sessions_opened_total") == 4
    assert grew("mokd_layers_created", "mokd_layers_created_total") == 4
    # tenants: two named sets, the rest under "other"; totals agree
    uid = str(os.getuid())
    tj = "mokd_tenant_jobs_completed"
    assert grew(tj, tj + "_total", uid=uid, client="prom-a") == 2
    assert grew(tj, tj + "_total", uid=uid, client="prom-b") == 3
    assert grew(tj, tj + "_total", uid="other", client="other") == 9
    assert grew("mokd_tenant_jobs_failed", "mokd_tenant_jobs_failed_total", uid="other",
                client="other") == 1
    assert not any(n in text for n in names[2:])


def test_histograms_are_consistent(mokd):
    sock, port = mokd
    run_jobs(sock)
    fams = families(scrape(port))
    hist = [f for f in fams.values() if f.type == "histogram"]
    assert [f.name for f in hist] == ["mokd_job_duration_seconds"]
    f = hist[0]
    series = {}
    for s in f.samples:
        key = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
        series.setdefault(key, {"buckets": [], "count": None, "sum": None})
        if s.name.endswith("_bucket"):
            series[key]["buckets"].append((float(s.labels["le"]), s.value))
        elif s.name.endswith("_count"):
            series[key]["count"] = s.value
        elif s.name.endswith("_sum"):
            series[key]["sum"] = s.value
    assert {dict(k)["op"] for k in series} >= {"forward", "nop"}
    bounds = None
    for key, h in series.items():
        b = sorted(h["buckets"])
        assert b[-1][0] == math.inf, key
        assert b[-1][1] == h["count"] and h["count"] > 0, key
        assert all(x[1] <= y[1] for x, y in zip(b, b[1:])), ("not cumulative", key, b)
        assert h["sum"] is not None and h["sum"] >= 0
        assert h["sum"] < h["count"] * 60  # no job took a minute
        les = [x[0] for x in b]
        assert bounds is None or les == bounds, "every op has the same fixed bounds"
        bounds = les
    assert len(bounds) == 20 and bounds[0] == 5e-05 and bounds[-2] == 60


def test_labels_are_bounded(mokd):
    sock, port = mokd
    before = value(families(scrape(port)), "mokd_jobs_completed", "mokd_jobs_completed_total",
                   op="forward")
    for _ in range(3):  # more sessions under more names: no new label sets
        run_jobs(sock)
    fams = families(scrape(port))
    allowed = {"op", "status", "le", "kind", "reason", "code", "state", "group", "rank",
               "world", "transport", "uid", "client", "bound", "version", "engine", "device"}
    for f in fams.values():
        for s in f.samples:
            assert set(s.labels) <= allowed, (s.name, s.labels)
            assert "session" not in s.labels
            if "op" in s.labels:
                assert s.labels["op"] in OPS
    for name, f in fams.items():
        if not name.startswith("mokd_tenant_") or name == "mokd_tenant_label_sets":
            continue
        sets = {(s.labels["uid"], s.labels["client"]) for s in f.samples}
        assert len(sets) <= MAX_LABEL_SETS + 1, (name, sets)
        assert ("other", "other") in sets
    assert value(fams, "mokd_tenant_label_sets", "mokd_tenant_label_sets", bound="max") == \
        MAX_LABEL_SETS
    # a fixed list of reasons and codes, every one present
    reasons = {s.labels["reason"] for s in fams["mokd_refusals"].samples}
    assert "max-sessions" in reasons and "other" in reasons and len(reasons) < 32
    codes = {s.labels["code"] for s in fams["mokd_http_responses"].samples}
    assert {"200", "400", "404", "405", "413"} <= codes
    # sessions are gone, their counts are not
    assert value(fams, "mokd_sessions", "mokd_sessions") == 0
    assert value(fams, "mokd_jobs_completed", "mokd_jobs_completed_total", op="forward") == \
        before + 30


def test_the_dashboard_queries_what_the_page_serves(mokd):
    """Every series deploy/grafana/mokd.json queries is on a live page
    (families with no samples yet, e.g. groups, count: their TYPE is there)."""
    import json
    import re
    sock, port = mokd
    run_jobs(sock)
    text = scrape(port)
    names = set()
    for f in parser.text_string_to_metric_families(text):
        names.add(f.name)
        names |= {s.name for s in f.samples}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, n, t = line.split()
            names.add(n)
            if t == "histogram":
                names |= {n + "_bucket", n + "_sum", n + "_count"}
    with open(os.path.join(REPO, "deploy", "grafana", "mokd.json")) as f:
        dash = json.load(f)
    for p in dash["panels"]:
        for t in p.get("targets", []):
            for n in re.findall(r"\b(mokd_[a-z0-9_]+)", t["expr"]):
                assert n in names, (p["title"], n)
