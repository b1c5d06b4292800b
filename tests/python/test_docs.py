# SPDX-License-Identifier: Apache-2.0
"""The documentation speaks of this repository alone: every relative link in
a tracked Markdown file resolves to a tracked file (and to a heading of it,
for a #anchor), and no text points outside the repository (a design
document elsewhere, numbered issues) or to a particular machine's tools
(scripts take their output folders as options, not from $OUT)."""
import os
import re
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tracked():
    try:
        out = subprocess.run(["git", "-C", REPO, "ls-files", "-z"], capture_output=True,
                             text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    files = [f for f in out.split("\0") if f and os.path.isfile(os.path.join(REPO, f))]
    return [f for f in files if not f.startswith("tests/bench/results/")]


def slug(heading):
    """A heading's anchor as Markdown renderers on code hosts make it."""
    s = heading.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def anchors(path):
    text = open(os.path.join(REPO, path), encoding="utf-8").read()
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.*)$", text, re.M)}


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_every_relative_link_resolves():
    files = set(tracked())
    bad = []
    for md in sorted(f for f in files if f.endswith(".md")):
        text = open(os.path.join(REPO, md), encoding="utf-8").read()
        text = re.sub(r"```.*?```", "", text, flags=re.S)
        for target in LINK.findall(text):
            if re.match(r"^[a-z]+:", target):
                bad.append("%s: %s (a link outside the repository)" % (md, target))
                continue
            path, _, anchor = target.partition("#")
            full = os.path.normpath(os.path.join(os.path.dirname(md), path)) if path else md
            if path and not (full in files or any(f.startswith(full.rstrip("/") + "/")
                                                  for f in files)):
                bad.append("%s: %s (no such file)" % (md, target))
            elif anchor and full.endswith(".md") and anchor not in anchors(full):
                bad.append("%s: %s (no such heading)" % (md, target))
    assert not bad, "\n".join(bad)


def test_design_page_has_the_sections_others_cite():
    have = anchors("docs/design.md")
    for a in ("the-layer", "processes-and-threads", "control-socket", "sessions",
              "rings-and-jobs", "regions", "fences", "engines", "workspaces",
              "expert-parallel-groups", "determinism", "security-model", "operation",
              "kernels", "benchmark-shapes", "public-interfaces"):
        assert a in have, a


OUTSIDE = [
    (re.compile(r"DESIGN(\.md| *§)"), "the design lives in docs/design.md"),
    (re.compile(r"\.\./shared/|\bshared/DESIGN"), "a folder outside the repository"),
    (re.compile(r"§ *\d"), "a section number of a document outside the repository"),
    (re.compile(r"\b[Ii]ssues? *#?\d+\b"), "an issue number"),
]
TOOLS = [
    (re.compile(r"\$\{?OUT\b(?!DIR)"), "$OUT: take the output folder as an option"),
    (re.compile(r"\bfiles_(at|fetch)\b|\bnvidia-h200(-x\d)?\b|kind nvidia"),
     "a particular machine's tool"),
]


def test_no_reference_outside_the_repository():
    bad = []
    me = "tests/python/test_docs.py"
    for f in tracked():
        if f in (me, "LICENSE"):
            continue
        try:
            text = open(os.path.join(REPO, f), encoding="utf-8").read()
        except UnicodeDecodeError:
            continue
        rules = OUTSIDE + (TOOLS if f.endswith((".sh", ".md", ".py")) or "/" not in f else [])
        for n, line in enumerate(text.splitlines(), 1):
            for rx, why in rules:
                if rx.search(line):
                    bad.append("%s:%d: %s: %s" % (f, n, why, line.strip()[:100]))
    assert not bad, "\n".join(bad)
