# SPDX-License-Identifier: Apache-2.0
"""deploy/spdx.sh: every source file names its license (Apache-2.0).

test_tree_has_spdx_headers holds the repository itself to it. The others run
--fix on copies, never on the repository: on a copy of every tracked file
(the result must pass --check, differ from the original only by the one
inserted line, keep shebangs first, compile, and stay put under a second
--fix) and on small hostile cases.
"""
import os
import py_compile
import shutil
import stat
import subprocess

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPT = os.path.join(REPO, "deploy", "spdx.sh")
HEADERS = {
    "c": "/* SPDX-License-Identifier: Apache-2.0 */",
    "slash": "// SPDX-License-Identifier: Apache-2.0",
    "hash": "# SPDX-License-Identifier: Apache-2.0",
}
WARN = ["-Wall", "-Wextra", "-Werror", "-Wshadow", "-Wno-unused-parameter",
        "-Wstrict-prototypes"]


def env():
    e = dict(os.environ)
    e.pop("LD_PRELOAD", None)  # a sanitizer runtime is for libmok, not for git and gcc
    return e


def run(*args, cwd=None):
    return subprocess.run(list(args), cwd=cwd, env=env(), capture_output=True, text=True,
                          timeout=300)


def tracked(root):
    out = run("git", "-C", root, "ls-files", "-z").stdout
    return [f for f in out.split("\0") if f]


def style(path):
    base = os.path.basename(path)
    if base.endswith((".c", ".h", ".cu", ".cuh")):
        return "c"
    if base.endswith(".proto"):
        return "slash"
    if base.endswith((".py", ".sh", ".mk", ".service", ".socket", ".target", ".service.in",
                      ".socket.in", ".conf", ".conf.in", ".pc.in", ".toml")) or \
            base in ("Makefile", "MANIFEST.in"):
        return "hash"
    with open(path, "rb") as f:
        return "hash" if f.read(2) == b"#!" else None


@pytest.fixture(scope="module")
def fixed_copy(tmp_path_factory):
    """Every tracked file (as it is in the work tree) copied, made a git tree,
    then --fix. Returns (copy, {path: original text})."""
    if not shutil.which("git"):
        pytest.skip("git is not installed")
    root = str(tmp_path_factory.mktemp("spdx-tree"))
    files = tracked(REPO)
    if "deploy/spdx.sh" not in files:
        files.append("deploy/spdx.sh")  # not yet committed
    original = {}
    for f in files:
        src = os.path.join(REPO, f)
        if not os.path.isfile(src):
            continue
        dst = os.path.join(root, f)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copy2(src, dst)
        with open(src, encoding="utf-8", errors="surrogateescape") as fh:
            original[f] = fh.read()
    assert run("git", "init", "-q", cwd=root).returncode == 0
    assert run("git", "add", "-A", cwd=root).returncode == 0
    r = run(os.path.join(root, "deploy", "spdx.sh"), "--fix", cwd=root)
    assert r.returncode == 0, r.stdout + r.stderr
    return root, original


def test_tree_has_spdx_headers():
    r = run(SCRIPT, "--check", cwd=REPO)
    assert r.returncode == 0, (
        "files without 'SPDX-License-Identifier: Apache-2.0' in their first 5 lines "
        "(run deploy/spdx.sh --fix):\n" + r.stdout + r.stderr)
    assert r.stdout == ""


def test_fix_then_check_passes_and_inserts_exactly_one_line(fixed_copy):
    root, original = fixed_copy
    r = run(os.path.join(root, "deploy", "spdx.sh"), "--check", cwd=root)
    assert r.returncode == 0 and r.stdout == "", r.stdout + r.stderr
    sources = 0
    for f, before in original.items():
        with open(os.path.join(root, f), encoding="utf-8", errors="surrogateescape") as fh:
            after = fh.read()
        kind = style(os.path.join(root, f))
        if kind is None:
            assert after == before, "%s is no source file but was changed" % f
            continue
        sources += 1
        old, new = before.splitlines(True), after.splitlines(True)
        if any("SPDX-License-Identifier: Apache-2.0" in line for line in old[:5]):
            assert after == before, f
            continue
        assert len(new) == len(old) + 1, f
        at = 1 if old and old[0].startswith("#!") else 0
        assert new[at] == HEADERS[kind] + "\n", (f, new[at])
        assert new[:at] + new[at + 1:] == old, "%s: more than the header changed" % f
    assert sources > 100  # the tree's C, CUDA, Python, shell, units... were all seen


def test_fix_is_idempotent(fixed_copy):
    root, _ = fixed_copy
    files = tracked(root)
    before = {f: open(os.path.join(root, f), "rb").read() for f in files}
    r = run(os.path.join(root, "deploy", "spdx.sh"), "--fix", cwd=root)
    assert r.returncode == 0, r.stderr
    assert "added the header to 0 file(s)" in r.stdout, r.stdout
    for f in files:
        assert open(os.path.join(root, f), "rb").read() == before[f], f


def test_fix_keeps_shebangs_and_modes(fixed_copy):
    root, original = fixed_copy
    seen = 0
    for f, before in original.items():
        if not before.startswith("#!"):
            continue
        seen += 1
        with open(os.path.join(root, f)) as fh:
            lines = fh.read().splitlines()
        assert lines[0] == before.splitlines()[0], f
        assert lines[1] == HEADERS["hash"], f
        assert os.stat(os.path.join(root, f)).st_mode == os.stat(os.path.join(REPO, f)).st_mode, f
    assert seen > 10


def test_fixed_sources_still_compile(fixed_copy):
    root, _ = fixed_copy
    files = tracked(root)
    gen = os.path.join(root, "build", "gen")
    os.makedirs(gen)
    protoc = shutil.which("protoc-c")
    if not protoc or not shutil.which("gcc"):
        pytest.skip("protoc-c or gcc is not installed")
    r = run(protoc, "--proto_path=proto", "--c_out=" + gen, "proto/mok.proto", cwd=root)
    assert r.returncode == 0, r.stderr  # the .proto with its // header
    inc = ["-I" + d for d in ("proto", gen, "daemon", "client/include", "client/src", "kernels",
                              "tests", "tests/ref", "tests/fuzz")]
    cuda_only = ("daemon/cuda/engine.c", "daemon/cuda/ep.c")
    failures = []
    compiled = 0
    for f in files:
        if not f.endswith(".c") or f in cuda_only or f.startswith("tests/gpu/"):
            continue
        r = run("gcc", "-std=c11", "-D_GNU_SOURCE", "-pthread", "-fsyntax-only", *WARN, *inc, f,
                cwd=root)
        compiled += 1
        if r.returncode:
            failures.append("%s:\n%s" % (f, r.stderr))
    assert not failures, "\n".join(failures)
    assert compiled > 50
    # the CUDA sources and the headers they include, where nvcc is here
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc"
                                    if os.access("/usr/local/cuda/bin/nvcc", os.X_OK) else None)
    # (the CUTLASS configurations with the headers deploy/cutlass.sh put in this
    # repository, where it ran: they are ignored, so not in the copy)
    cutlass = os.path.join(REPO, ".deps", "cutlass-4.2.0")
    cutlass_inc = ["-I" + os.path.join(cutlass, "include"),
                   "-I" + os.path.join(cutlass, "tools", "util", "include")]
    if nvcc:
        for f in files:
            if f.startswith("kernels/") and f.endswith(".cu"):
                extra = []
                if f.startswith("kernels/cutlass_gemm/cfg_"):
                    if not os.path.isdir(cutlass):
                        continue
                    extra = cutlass_inc
                r = run(nvcc, "-std=c++17", "-E", "-Ikernels", "-Iproto", *extra, f,
                        "-o", os.devnull, cwd=root)
                assert r.returncode == 0, "%s:\n%s" % (f, r.stderr)
    shells = 0
    for f in files:
        path = os.path.join(root, f)
        with open(path, "rb") as fh:
            first = fh.readline()
        if f.endswith(".py"):
            py_compile.compile(path, cfile=os.path.join(root, "build", "pyc"), doraise=True)
        elif f.endswith(".sh") or (first.startswith(b"#!") and first.rstrip().endswith(b"sh")):
            r = run("bash", "-n", path)
            assert r.returncode == 0, "%s: %s" % (f, r.stderr)
            shells += 1
    assert shells > 10


def write(path, text, mode=0o644):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, mode)


def test_hostile_and_odd_files(tmp_path):
    root = str(tmp_path)
    write(os.path.join(root, "deploy", "spdx.sh"), open(SCRIPT).read(), 0o755)
    cases = {
        "a b/odd name.c": "int x;\n",
        "empty.h": "",
        "tool": "#!/bin/sh\necho hi\n",          # no extension, a shebang
        "only_shebang.sh": "#!/bin/sh",             # no newline at all
        "coded.py": "#!/usr/bin/env python3\n# -*- coding: utf-8 -*-\nprint(1)\n",
        "coded2.py": "# vim: set fileencoding=latin-1 :\nprint(2)\n",
        "late.py": "a = 1\nb = 2\nc = 3\nd = 4\ne = 5\n# SPDX-License-Identifier: Apache-2.0\n",
        "mit.c": "/* SPDX-License-Identifier: MIT */\nint y;\n",
        "done.cu": "// SPDX-License-Identifier: Apache-2.0\n__global__ void k() {}\n",
        "notes.md": "# not source\n",
        "data.json": "{}\n",
        "x.proto": 'syntax = "proto3";\n',
        "u/mokd@.socket.in": "[Socket]\n",
        "Makefile": "all:\n\ttrue\n",
    }
    for name, text in cases.items():
        write(os.path.join(root, name), text, 0o755 if text.startswith("#!") else 0o640)
    assert run("git", "init", "-q", cwd=root).returncode == 0
    assert run("git", "add", "-A", cwd=root).returncode == 0
    spdx = os.path.join(root, "deploy", "spdx.sh")

    r = run(spdx, "--check", cwd=root)
    assert r.returncode == 1
    listed = set(r.stdout.splitlines())
    assert listed == {"a b/odd name.c", "empty.h", "tool", "only_shebang.sh", "coded.py",
                      "coded2.py", "late.py", "x.proto", "u/mokd@.socket.in", "Makefile"}, listed
    assert "mit.c (MIT) names another license" in r.stderr, r.stderr

    r = run(spdx, "--fix", cwd=root)
    assert r.returncode == 1, r.stdout  # mit.c is not ours to relicense
    assert "added the header to 10 file(s)" in r.stdout, r.stdout
    got = {n: open(os.path.join(root, n)).read() for n in cases}
    assert got["a b/odd name.c"] == HEADERS["c"] + "\nint x;\n"
    assert got["empty.h"] == HEADERS["c"] + "\n"
    assert got["tool"] == "#!/bin/sh\n" + HEADERS["hash"] + "\necho hi\n"
    assert got["only_shebang.sh"] == "#!/bin/sh\n" + HEADERS["hash"] + "\n"
    assert got["coded.py"] == ("#!/usr/bin/env python3\n# -*- coding: utf-8 -*-\n" +
                               HEADERS["hash"] + "\nprint(1)\n")
    assert got["coded2.py"] == "# vim: set fileencoding=latin-1 :\n" + HEADERS["hash"] + "\nprint(2)\n"
    assert got["late.py"].startswith(HEADERS["hash"] + "\na = 1\n")
    assert got["x.proto"] == HEADERS["slash"] + '\nsyntax = "proto3";\n'
    assert got["Makefile"] == HEADERS["hash"] + "\nall:\n\ttrue\n"
    for untouched in ("mit.c", "done.cu", "notes.md", "data.json"):
        assert got[untouched] == cases[untouched], untouched
    assert stat.S_IMODE(os.stat(os.path.join(root, "tool")).st_mode) == 0o755
    assert stat.S_IMODE(os.stat(os.path.join(root, "empty.h")).st_mode) == 0o640

    r = run(spdx, "--check", cwd=root)
    assert r.returncode == 1 and r.stdout == "", r.stdout  # only mit.c is left, on stderr
    assert "mit.c (MIT)" in r.stderr
    again = run(spdx, "--fix", cwd=root)
    assert "added the header to 0 file(s)" in again.stdout
    assert {n: open(os.path.join(root, n)).read() for n in cases} == got

    # named files: only those; a missing one is an error
    write(os.path.join(root, "new.c"), "int z;\n")
    r = run(spdx, "--check", "new.c", "done.cu", cwd=root)
    assert r.returncode == 1 and r.stdout.split() == ["new.c"]
    r = run(spdx, "--check", "nowhere.c", cwd=root)
    assert r.returncode == 1 and "nowhere.c: no such file" in r.stderr


def test_usage_errors():
    r = run(SCRIPT)
    assert r.returncode == 2 and "--check or --fix" in r.stderr
    r = run(SCRIPT, "--fixx")
    assert r.returncode == 2
