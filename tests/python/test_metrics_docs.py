# SPDX-License-Identifier: Apache-2.0
"""The metrics' paper trail, without a daemon: every series the page renders
(daemon/metrics.c) is listed in docs/metrics.md, every series the Grafana
dashboard (deploy/grafana/mokd.json) queries is one the page renders, and
the dashboard is well-formed JSON that Grafana can import.
"""
import json
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def read(path):
    with open(os.path.join(REPO, path)) as f:
        return f.read()


def rendered():
    """name -> type, from the family() calls and the tenant table of metrics.c."""
    src = read("daemon/metrics.c")
    fams = dict(re.findall(r'family\(&?pg, "(mokd_[a-z0-9_]+)", "(counter|gauge|histogram)"', src))
    fams.update(re.findall(r'\{"(mokd_tenant_[a-z0-9_]+)", "(counter|gauge)"', src))
    return fams


def test_every_rendered_series_is_documented():
    fams = rendered()
    assert len(fams) >= 30, fams
    docs = read("docs/metrics.md")
    for name, typ in fams.items():
        assert "`%s`" % name in docs or "`%s{" % name in docs, "docs/metrics.md lacks " + name
        if typ == "counter":
            assert name.endswith("_total"), name
        else:
            assert not name.endswith("_total"), name
    documented = {n for n in re.findall(r"`(mokd_[a-z0-9_]+)", docs) if not n.endswith("_")}
    hist = {n + s for n, t in fams.items() if t == "histogram" for s in ("_bucket", "_sum", "_count")}
    assert documented <= set(fams) | hist, "documented, never rendered: %s" % (documented - set(fams) - hist)


def test_the_dashboard_queries_rendered_series():
    fams = rendered()
    names = set(fams)
    for n, t in fams.items():
        if t == "histogram":
            names |= {n + "_bucket", n + "_sum", n + "_count"}
    dash = json.loads(read("deploy/grafana/mokd.json"))
    assert dash["title"] == "mokd" and dash["uid"] and dash["schemaVersion"] >= 30
    var = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "instance"} <= var
    used = set()
    ids = set()
    for p in dash["panels"]:
        assert p["id"] not in ids
        ids.add(p["id"])
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0
        if p["type"] == "row":
            continue
        assert p["targets"], p["title"]
        for t in p["targets"]:
            expr = t["expr"]
            assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
            for n in re.findall(r"\b(mokd_[a-z0-9_]+)", expr):
                assert n in names, "%s: %s is not a series mokd renders" % (p["title"], n)
                used.add(n)
            assert re.search(r"\bmokd_|\bup\{", expr), expr
    # what the brief of the dashboard promises
    for want in ("mokd_jobs_completed_total", "mokd_jobs_failed_total",
                 "mokd_job_duration_seconds_bucket", "mokd_memory_bytes", "mokd_sessions",
                 "mokd_group_timeouts_total", "mokd_group_rank_missed_total"):
        assert want in used, want
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p.get("targets", []))
    assert "histogram_quantile(0.99" in exprs and "histogram_quantile(0.5" in exprs
