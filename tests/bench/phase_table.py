#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Where a job's time goes, step by step, in one process and through mokd.

    phase_table.py AB.json MOKD.log

AB.json: `mok_bench_daemon --inproc-ab 1 --phases 1 --out AB.json` (the
in-process chain's median per step, the client's medians of both sides).
MOKD.log: the log of the mokd it ran against, started with
MOK_CUDA_PROFILE=1 at log level info: one "phases" line per job, each
kernel, copy and memset from the client's fence to the status word.

The jobs of a configuration come in the bench's order: its forward loop
(warm-up, then reps jobs), its backward loop (a forward and a backward
each), then one forward and one backward for the bitwise comparison. The
medians here are over the timed jobs of each loop. Printed per
configuration and direction: each mokd step beside the in-process step it
runs (the same library call), the steps only mokd runs, and the split of
the client-measured cost into the fence and protocol (client time less
mokd's span), the matched steps' difference, and mokd's own steps.
"""
import json
import re
import statistics
import sys

LINE = re.compile(r"cuda engine: (\w+) phases \(ms\) (T=\d+ [^:]*): (.*?); total ([\d.]+)(?:; cpu \(us\): (.*))?")
# mokd step (with its ordinal among same-named steps) -> the in-process step
MATCH = {
    "forward": {"schedule_build": "schedule_build", "schedule_build_snapshot": "schedule_build",
                "gather_rows": "gather",
                # mokd's forward gathers x inside expert_forward_gathering (logs
                # before that had a gather_rows of x first)
                "expert_forward": "expert_forward", "expert_forward_gathering": "expert_forward",
                "shared_forward": "shared_forward",
                "combine": "combine"},
    # mokd's backward runs in one routed buffer: expert_backward_in_place
    # includes the K-sum (dispatch_backward) and x's gather (older logs:
    # expert_backward_gathering and a dispatch_backward; before those a
    # gather_rows of x first, and d_out's as gather_rows#2)
    "backward": {"gather_rows": "gather_d_out",
                 "expert_backward_in_place": "expert_backward",
                 "expert_backward_gathering": "expert_backward",
                 "shared_backward": "shared_backward", "dispatch_backward": "dispatch_backward"},
}


def ordinal_steps(text):
    """"a 1, b 2, a 3" -> [("a", 1.0), ("b", 2.0), ("a#2", 3.0)]"""
    seen, steps = {}, []
    for item in text.split(", "):
        name, _, v = item.rpartition(" ")
        seen[name] = seen.get(name, 0) + 1
        steps.append((name if seen[name] == 1 else f"{name}#{seen[name]}", float(v)))
    return steps


def parse_log(path):
    """[(op, label, {step: GPU ms} in the job's order, {step: host us to
    enqueue it})] in the log's order; the host's times include "take" (from
    taking the job to its first mark)"""
    jobs = []
    with open(path, errors="replace") as f:
        for line in f:
            m = LINE.search(line)
            if not m:
                continue
            cpu = dict(ordinal_steps(m.group(5))) if m.group(5) else {}
            jobs.append((m.group(1), m.group(2), dict(ordinal_steps(m.group(3))), cpu))
    return jobs


def median_of(jobs, field, name):
    """the median of step `name` in field 2 (GPU ms) or 3 (host us) of jobs"""
    vals = [j[field][name] for j in jobs if name in j[field]]
    return statistics.median(vals) if vals else float("nan")


def medians(jobs):
    """the median of each step over jobs (the steps of the first job, in
    order): [(step, GPU ms, host us)]"""
    return [(n, median_of(jobs, 2, n), median_of(jobs, 3, n)) for n in jobs[0][2]]


def main(argv):
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    doc = json.load(open(argv[1]))
    jobs = parse_log(argv[2])
    if not jobs:
        print(f"phase_table: no phase lines in {argv[2]} (mokd without MOK_CUDA_PROFILE=1, "
              "or its log level above info)", file=sys.stderr)
        return 1
    w, r = doc["warmup"], doc["reps"]
    per_op = {"forward": [j for j in jobs if j[0] == "forward"],
              "backward": [j for j in jobs if j[0] == "backward"]}
    per_config = {"forward": 2 * (w + r) + 1, "backward": (w + r) + 1}
    at = {"forward": 0, "backward": 0}
    print(f"steps through mokd against in-process (ms, medians of {r} jobs), "
          f"client wait: {doc.get('client_wait', 'stream')}")
    for res in doc["results"]:
        if not res.get("ok"):
            continue
        for op, key, inproc_key, client_key in (
                ("forward", "inproc_fwd_phases_ms", "inproc_fwd_ms", "fwd_ms"),
                ("backward", "inproc_bwd_phases_ms", "inproc_bwd_ms", "bwd_ms")):
            chunk = per_op[op][at[op]:at[op] + per_config[op]]
            at[op] += per_config[op]
            if len(chunk) < w + r or key not in res:
                print(f"{res['shape']} T={res['T']} {res['routing']} {op}: "
                      f"{len(chunk)} phase lines, too few")
                continue
            timed = medians(chunk[w:w + r])
            take = median_of(chunk[w:w + r], 3, "take")
            cpu = {n: c for n, _, c in timed}
            inproc = res[key]
            span = sum(ms for _, ms, _ in timed)
            matched = [(n, ms, inproc[MATCH[op][n]]) for n, ms, _ in timed if n in MATCH[op]]
            own = [(n, ms) for n, ms, _ in timed if n not in MATCH[op]]
            d_matched = sum(a - b for _, a, b in matched)
            own_ms = sum(ms for _, ms in own)
            client_b, client_a = res[client_key], res[inproc_key]
            print(f"\n{res['shape']} T={res['T']} {res['routing']} {op} ({chunk[0][1]})")
            print(f"  {'step':<20} {'mokd':>9} {'in-proc':>9} {'diff':>8}   host us to enqueue")
            parts = ", ".join(f"{k} {median_of(chunk[w:w + r], 3, k):.1f}"
                              for k in ("to_start", "fence_wait", "start_event", "first_mark",
                                        "prepare_checks", "prepare_workspace")
                              if k in chunk[0][3])
            print(f"  {'(take to start)':<20} {'':>9} {'':>9} {'':>8}   {take:7.1f}"
                  + (f"  ({parts})" if parts else ""))
            for n, a, b in matched:
                print(f"  {n:<20} {a:9.4f} {b:9.4f} {a - b:+8.4f}   {cpu[n]:7.1f}")
            for n, ms in own:
                print(f"  {n:<20} {ms:9.4f} {'-':>9} {ms:+8.4f}   {cpu[n]:7.1f}")
            if op == "forward" and "submit_fwd_us" in res:
                print(f"  the client's submission call (host): {res['submit_fwd_us']:.1f} us")
            print(f"  client: in-process {client_a:.4f}, through mokd {client_b:.4f}, "
                  f"cost {1e3 * (client_b - client_a):+.1f} us = "
                  f"fence and protocol {1e3 * (client_b - span):+.1f} "
                  f"+ matched steps {1e3 * d_matched:+.1f} + mokd's own steps {1e3 * own_ms:+.1f} "
                  f"+ in-process's event overhead {1e3 * (sum(inproc.values()) - client_a):+.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
