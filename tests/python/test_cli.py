# SPDX-License-Identifier: Apache-2.0
"""The operator's side of mokd and mokctl: usage, versions, errors on a bad
command line, the man pages (held to the code's own tables so they cannot
drift), where make install puts them, the socket directory message and the
log line format.
"""
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD = os.path.join(REPO, os.environ.get("MOK_BUILD") or "build")
MOKD = os.path.join(BUILD, "bin", "mokd")
MOKCTL = os.path.join(BUILD, "bin", "mokctl")
LIBMOK = os.path.join(BUILD, "lib", "libmok.so")
MAN = os.path.join(REPO, "docs", "man")

pytestmark = pytest.mark.skipif(not (os.path.exists(MOKD) and os.path.exists(MOKCTL)),
                                reason="mokd and mokctl are not built (run make)")


def run(*argv, **kw):
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=30, **kw)


def read(*parts):
    with open(os.path.join(REPO, *parts)) as f:
        return f.read()


def the_version():
    m = re.search(r'^#define MOK_VERSION "([^"]+)"$', read("proto", "mok_version.h"), re.M)
    assert m, "proto/mok_version.h has no MOK_VERSION"
    return m.group(1)


# ---- the code's own tables ------------------------------------------------------------

def mokd_options():
    src = read("daemon", "main.c")
    block = src[src.index("static const struct option opts[]"):]
    block = block[:block.index("{0, 0, 0, 0}")]
    opts = re.findall(r'\{"([a-z-]+)", (?:no|required)_argument', block)
    assert len(opts) >= 9 and "socket" in opts and "list-engines" in opts, opts
    return opts


def mokctl_commands():
    src = read("client", "tools", "mokctl.c")
    block = src[src.index("} commands[] = {"):]
    block = block[:block.index("};")]
    cmds = re.findall(r'\{"([a-z-]+)", "', block)
    assert {"status", "metrics", "help", "version"} <= set(cmds), cmds
    return cmds


def config_keys():
    src = read("daemon", "config.c")
    body = src[src.index("int mok_config_set("):src.index("static char *trim(")]
    keys = set(re.findall(r'strcmp\(key, "([a-z-]+)"\)', body))
    keys |= set(re.findall(r'\{"([a-z-]+)", (?:\d|UINT)', body))
    assert len(keys) >= 30 and {"socket", "max-sessions", "group-dir", "idle-spin-us"} <= keys, keys
    return keys


def man_text(page):
    return read("docs", "man", page).replace("\\-", "-")


def tagged_heads(page, section=None):
    """The first word of every .TP entry's head line (in one .SH section, or all)."""
    text = man_text(page)
    if section:
        text = text[text.index(".SH " + section):]
        nxt = text.find("\n.SH ", 1)
        text = text[:nxt] if nxt > 0 else text
    return [m.group(1) for m in re.finditer(r'^\.TP\n\.(?:B|BR|BI) "?([^\s"]+)', text, re.M)]


# ---- usage and versions ---------------------------------------------------------------

def test_mokctl_help_lists_every_command_and_exits_0():
    outs = set()
    for arg in ("-h", "--help", "help"):
        r = run(MOKCTL, arg)
        assert r.returncode == 0 and r.stderr == "", (arg, r)
        outs.add(r.stdout)
    assert len(outs) == 1, "the three ways to ask give different usage"
    text = outs.pop()
    assert text.startswith("usage: mokctl")
    for cmd in mokctl_commands():
        lines = [l for l in text.splitlines() if re.match(r"^  %s\b" % cmd, l)]
        assert len(lines) == 1, (cmd, text)  # one line each, with what it does
        assert len(lines[0].split()) > 1, lines
    for opt in ("--socket", "--json", "--help", "--version"):
        assert opt in text, opt


def test_mokd_help_lists_every_option_and_exits_0():
    for arg in ("-h", "--help"):
        r = run(MOKD, arg)
        assert r.returncode == 0 and r.stderr == "", (arg, r)
        for opt in mokd_options():
            assert re.search(r"^  (-\w, )?--%s\b" % opt, r.stdout, re.M), (opt, r.stdout)


def test_versions_come_from_one_place():
    v = the_version()
    for argv, want in (([MOKD, "--version"], "mokd " + v), ([MOKD, "-V"], "mokd " + v),
                       ([MOKCTL, "--version"], "mokctl " + v), ([MOKCTL, "-V"], "mokctl " + v)):
        r = run(*argv)
        assert r.returncode == 0 and r.stdout == want + "\n" and r.stderr == "", (argv, r)
    assert "MOK_VERSION" not in read("daemon", "server.h").replace('#include "mok_version.h"', "")
    # libmok exports it; the Python binding reads it there
    syms = run("nm", "-D", "--defined-only", LIBMOK).stdout if shutil.which("nm") else ""
    assert not syms or re.search(r" T mok_version@@MOK_1$", syms, re.M), "libmok does not export mok_version"
    # in this process (a second python could not load a TSan build's libmok)
    sys.path.insert(0, os.path.join(REPO, "client", "python"))
    os.environ.setdefault("MOK_LIBRARY", LIBMOK)
    import mok
    assert mok.version() == v and mok.__version__ == v
    with pytest.raises(AttributeError):
        mok.__nothing__


@pytest.mark.parametrize("tool,argv,needle", [
    ("mokctl", ["frobnicate"], 'unknown command "frobnicate"'),
    ("mokctl", ["--frob"], 'unknown option "--frob"'),
    ("mokctl", ["-x", "status"], 'unknown option "-x"'),
    ("mokctl", ["status", "metrics"], 'unexpected argument "metrics"'),
    ("mokctl", ["--socket"], "--socket needs a PATH"),
    ("mokd", ["--frob"], "unrecognized option '--frob'"),
    ("mokd", ["-x"], "invalid option -- 'x'"),
    ("mokd", ["--socket"], "option '--socket' requires an argument"),
    ("mokd", ["stray"], 'unexpected argument "stray"'),
])
def test_a_bad_command_line_says_what_and_where_the_usage_is(tool, argv, needle):
    r = run(MOKD if tool == "mokd" else MOKCTL, *argv, env=dict(os.environ, MOK_SOCKET="/nonexistent"))
    assert r.returncode == 2, r
    assert r.stdout == ""
    lines = r.stderr.splitlines()
    assert lines[0] == "%s: %s" % (tool, needle), r.stderr  # named as itself, not by its path
    assert lines[-1].startswith("Try '%s --help'" % tool), r.stderr


def test_mokctl_version_asks_the_daemon_too(tmp_path):
    sock = str(tmp_path / "v.sock")
    p = subprocess.Popen([MOKD, "--socket", sock, "--engine", "cpu", "--log-level", "warn"])
    try:
        deadline = time.time() + 10
        while not os.path.exists(sock):
            assert p.poll() is None and time.time() < deadline, "mokd did not come up"
            time.sleep(0.02)
        r = run(MOKCTL, "--socket", sock, "version")
        v = the_version()
        assert r.returncode == 0 and r.stdout == "mokctl %s\nmokd %s\n" % (v, v), r
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(10) == 0
    r = run(MOKCTL, "--socket", sock, "version")  # no daemon: its own version, and why not mokd's
    assert r.returncode == 0 and r.stdout == "mokctl %s\n" % the_version(), r
    assert "mokd not reached" in r.stderr


# ---- man pages --------------------------------------------------------------------------

def test_mokd_conf_5_documents_exactly_the_config_keys():
    heads = set(tagged_heads("mokd.conf.5"))
    keys = config_keys()
    assert keys - heads == set(), "keys of daemon/config.c missing from mokd.conf(5)"
    assert heads - keys == set(), "mokd.conf(5) documents keys daemon/config.c does not take"


def test_mokd_8_documents_every_option():
    heads = set(h.rstrip(",") for h in tagged_heads("mokd.8", "OPTIONS"))
    text = man_text("mokd.8")
    opts = set("--" + o for o in mokd_options())
    # "-V, --version": the head's first word is the short form
    listed = heads | set(re.findall(r"^\.BR -\w+ \", \" (--[a-z-]+)", text, re.M))
    assert opts - listed == set(), "options of daemon/main.c missing from mokd(8)"
    assert listed - opts - {"-V", "-h"} == set(), "mokd(8) lists options mokd does not take"


def test_mokctl_1_documents_exactly_the_commands():
    heads = set(tagged_heads("mokctl.1", "COMMANDS"))
    assert heads == set(mokctl_commands()), heads
    text = man_text("mokctl.1")
    for opt in ("--socket", "--json", "--help", "--version"):
        assert opt in text, opt


def renderer():
    # not under a sanitizer's runtime that a sanitized test run preloads
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    if shutil.which("groff"):
        return lambda page: run("groff", "-man", "-Tutf8", "-ww", "-z", page, env=env)
    if shutil.which("man"):
        return lambda page: run("man", "--warnings", "-l", page, env=dict(env, MANPAGER="cat"))
    return None


@pytest.mark.parametrize("page", ["mokd.8", "mokctl.1", "mokd.conf.5"])
def test_man_pages_render_without_warnings(page):
    render = renderer()
    if render is None:
        pytest.skip("neither groff nor man is installed: man pages not rendered")
    r = render(os.path.join(MAN, page))
    assert r.returncode == 0 and r.stderr == "", (page, r.stderr)


def make(*args):
    env = dict(os.environ, NVCC="")  # installing needs no CUDA rebuild
    return subprocess.run(["make", "--no-print-directory", "-C", REPO, "BUILD=" + BUILD] + list(args),
                          env=env, capture_output=True, text=True, timeout=300)


def test_make_install_puts_the_man_pages_in_place():
    dest = tempfile.mkdtemp(prefix="mok-man-")
    try:
        r = make("install", "DESTDIR=" + dest)  # PREFIX: the default, /usr/local
        assert r.returncode == 0, r.stdout + r.stderr
        v = the_version()
        for page, sect in (("mokctl.1", 1), ("mokd.conf.5", 5), ("mokd.8", 8)):
            path = os.path.join(dest, "usr/local/share/man/man%d" % sect, page)
            assert os.path.isfile(path), path
            assert os.stat(path).st_mode & 0o777 == 0o644, oct(os.stat(path).st_mode)
            text = open(path).read()
            assert "@VERSION@" not in text and '"mok %s"' % v in text, page
            render = renderer()
            if render:
                rr = render(path)
                assert rr.returncode == 0 and rr.stderr == "", rr.stderr
        hdr = os.path.join(dest, "usr/local/include/mok/mok_version.h")
        assert os.path.isfile(hdr) and '"%s"' % v in open(hdr).read()
        pc = open(os.path.join(dest, "usr/local/lib/pkgconfig/mok.pc")).read()
        assert re.search(r"^Version: %s$" % re.escape(v), pc, re.M), pc
        r = make("uninstall", "DESTDIR=" + dest)
        assert r.returncode == 0, r.stderr
        for sect in (1, 5, 8):
            assert os.listdir(os.path.join(dest, "usr/local/share/man/man%d" % sect)) == []
    finally:
        shutil.rmtree(dest, ignore_errors=True)


# ---- start-up and logs ------------------------------------------------------------------

def test_a_missing_socket_directory_is_named_with_the_fix(tmp_path):
    missing = str(tmp_path / "run" / "mok")
    r = run(MOKD, "--socket", missing + "/mokd-0.sock", "--engine", "cpu")
    assert r.returncode == 1, r
    want = ("mokd: socket directory %s does not exist; create it (install -d -m 0755 %s) or pass "
            "--socket PATH" % (missing, missing))
    assert r.stderr.splitlines() == [want], r.stderr
    # the command it names makes it right
    fix = re.search(r"\((install [^)]*)\)", want).group(1).split()
    assert run(*fix).returncode == 0 and oct(os.stat(missing).st_mode & 0o777) == "0o755"
    p = subprocess.Popen([MOKD, "--socket", missing + "/mokd-0.sock", "--engine", "cpu",
                          "--log-level", "warn"])
    try:
        deadline = time.time() + 10
        while not os.path.exists(missing + "/mokd-0.sock"):
            assert p.poll() is None and time.time() < deadline, "mokd did not come up"
            time.sleep(0.02)
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(10) == 0
    # a file where the directory should be
    afile = tmp_path / "plain"
    afile.write_text("")
    r = run(MOKD, "--socket", str(afile) + "/mokd.sock", "--engine", "cpu")
    assert r.returncode == 1 and "socket directory %s is not a directory" % afile in r.stderr, r


def test_plain_stderr_log_lines_carry_utc_timestamps(tmp_path):
    sock = str(tmp_path / "log.sock")
    env = {k: v for k, v in os.environ.items() if k != "JOURNAL_STREAM"}
    start = datetime.now(timezone.utc)
    p = subprocess.Popen([MOKD, "--socket", sock, "--engine", "cpu", "--log-level", "info",
                          "--config", "-/nonexistent"], stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.time() + 10
        while not os.path.exists(sock):
            assert p.poll() is None and time.time() < deadline, "mokd did not come up"
            time.sleep(0.02)
    finally:
        p.send_signal(signal.SIGTERM)
        err = p.communicate(timeout=10)[1]
    end = datetime.now(timezone.utc)
    assert p.returncode == 0, err
    lines = err.splitlines()
    assert any(": info: mokd %s serving %s" % (the_version(), sock) in l for l in lines), err
    assert any(l.endswith(": info: mokd stopped") for l in lines), err
    pat = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3})Z mokd\[%d\]: (error|warn|info|debug): \S"
                     % p.pid)
    for l in lines:
        m = pat.match(l)
        assert m, "not a stamped log line: %r" % l
        t = datetime.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S.%f").replace(tzinfo=timezone.utc)
        assert start - timedelta(seconds=1) <= t <= end + timedelta(seconds=1), (l, start, end)
