# SPDX-License-Identifier: Apache-2.0
"""Deployment: systemd units, sd_notify, socket activation, make install.

These run the real mokd from the build tree (or from a DESTDIR install) the
way systemd would: with NOTIFY_SOCKET, WATCHDOG_USEC and LISTEN_FDS set.
"""
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD = os.path.join(REPO, os.environ.get("MOK_BUILD", "build"))
MOKD = os.path.join(BUILD, "bin", "mokd")

pytestmark = pytest.mark.skipif(not os.path.exists(MOKD), reason="mokd is not built (run make)")


def make(*args, **kw):
    env = dict(os.environ, NVCC="")  # the units and install need no CUDA rebuild
    return subprocess.run(["make", "--no-print-directory", "-C", REPO, "BUILD=" + BUILD] + list(args),
                          env=env, capture_output=True, text=True, **kw)


@pytest.fixture
def tmp():
    d = tempfile.mkdtemp(prefix="mok-deploy-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_units_verify_without_any_warning(tmp):
    if not shutil.which("systemd-analyze"):
        pytest.skip("systemd-analyze is not installed")
    out = os.path.join(tmp, "units")
    r = make("units", "UNITS_OUT=" + out, "BINDIR=" + os.path.dirname(MOKD),
             "MPS_CONTROL=/bin/true", "DOCDIR=" + REPO)
    assert r.returncode == 0, r.stderr
    for unit in ["mokd@0.service", "mokd@3.socket", "mok.target", "nvidia-mps.service"]:
        v = subprocess.run(["systemd-analyze", "verify", os.path.join(out, unit)],
                           capture_output=True, text=True)
        assert v.returncode == 0 and v.stdout == "" and v.stderr == "", (unit, v.stdout, v.stderr)
    service = open(os.path.join(out, "mokd@.service")).read()
    assert "Type=notify" in service and "WatchdogSec=" in service
    settings = "\n".join(l for l in service.splitlines() if not l.startswith("#"))
    assert "CUDA_VISIBLE_DEVICES" not in settings and "DeviceAllow" not in settings


class Notify:
    """A datagram socket standing in for systemd's NOTIFY_SOCKET."""

    def __init__(self, path):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.settimeout(10)
        self.seen = []

    def wait_for(self, key):
        deadline = time.time() + 10
        while time.time() < deadline:
            if any(key in m for m in self.seen):
                return
            self.seen.append(self.sock.recv(4096).decode())
        raise AssertionError("%s never arrived; got %r" % (key, self.seen))


def test_notify_ready_watchdog_and_stopping(tmp):
    notify = Notify(os.path.join(tmp, "notify"))
    sock = os.path.join(tmp, "mokd.sock")
    env = dict(os.environ, NOTIFY_SOCKET=notify.path, WATCHDOG_USEC="200000")
    p = subprocess.Popen([MOKD, "--socket", sock, "--engine", "cpu", "--log-level", "warn"], env=env)
    try:
        notify.wait_for("READY=1")
        notify.wait_for("STATUS=serving")
        notify.seen = []
        notify.wait_for("WATCHDOG=1")  # pinged every 100 ms
        notify.seen = []
        notify.wait_for("WATCHDOG=1")
        p.send_signal(signal.SIGTERM)
        notify.wait_for("STOPPING=1")
        assert p.wait(10) == 0
    finally:
        if p.poll() is None:
            p.kill()


def test_socket_activation(tmp):
    path = os.path.join(tmp, "activated.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(16)
    fd = listener.fileno()

    def as_fd3():
        os.dup2(fd, 3)
        os.set_inheritable(3, True)

    # LISTEN_PID must be mokd's own pid: a shell sets it, then execs mokd
    cmd = ["/bin/sh", "-c", 'LISTEN_PID=$$ LISTEN_FDS=1 exec "$0" "$@"', MOKD,
           "--socket", os.path.join(tmp, "unused.sock"), "--engine", "cpu", "--log-level", "warn"]
    # fd 3 is kept through subprocess's closing of inherited fds
    p = subprocess.Popen(cmd, preexec_fn=as_fd3, pass_fds=(3,))
    listener.close()  # mokd holds it now
    try:
        ctl = os.path.join(os.path.dirname(MOKD), "mokctl")
        out = ""
        for _ in range(100):
            r = subprocess.run([ctl, "--socket", path, "status"], capture_output=True, text=True)
            out = r.stdout
            if r.returncode == 0:
                break
            time.sleep(0.05)
        assert "cpu engine" in out, out
        assert not os.path.exists(os.path.join(tmp, "unused.sock"))  # it did not bind its own
        p.send_signal(signal.SIGTERM)
        assert p.wait(10) == 0
        assert os.path.exists(path)  # the socket belongs to systemd: mokd leaves it
    finally:
        if p.poll() is None:
            p.kill()


def test_bad_activation_is_refused(tmp):
    r = subprocess.run(["/bin/sh", "-c", 'LISTEN_PID=$$ LISTEN_FDS=1 exec "$0" --engine cpu', MOKD],
                       capture_output=True, text=True, timeout=10)
    assert r.returncode == 2
    assert "socket activation" in r.stderr


def test_make_install_then_run_the_installed_daemon_and_python_package(tmp):
    dest = os.path.join(tmp, "root")
    r = make("install", "DESTDIR=" + dest, "PREFIX=/usr", "SYSCONFDIR=/etc")
    assert r.returncode == 0, r.stdout + r.stderr
    for f in ["usr/bin/mokd", "usr/bin/mokctl", "usr/lib/libmok.so.1", "usr/lib/libmok.a",
              "usr/include/mok/mok.h", "usr/lib/pkgconfig/mok.pc", "etc/mok/mokd.conf",
              "usr/lib/systemd/system/mokd@.service", "usr/lib/sysusers.d/mok.conf",
              "usr/lib/python3/dist-packages/mok/__init__.py"]:
        assert os.path.exists(os.path.join(dest, f)), f
    sock = os.path.join(tmp, "installed.sock")
    conf = os.path.join(dest, "etc/mok/mokd.conf")
    p = subprocess.Popen([os.path.join(dest, "usr/bin/mokd"), "--socket", sock, "--config", conf,
                          "--engine", "cpu", "--log-level", "warn"])
    try:
        for _ in range(100):
            if os.path.exists(sock):
                break
            time.sleep(0.05)
        script = (
            "import numpy as np, mok\n"
            "assert mok.__file__.startswith(PREFIX), mok.__file__\n"
            "c = mok.connect(SOCK)\n"
            "L = c.layer(hidden=16, intermediate=8, experts=4, topk=2, dtype='float32')\n"
            "rng = np.random.default_rng(0)\n"
            "x = rng.standard_normal((8, 16)).astype(np.float32)\n"
            "ids = np.array([[i % 4, (i + 1) % 4] for i in range(8)], np.int32)\n"
            "rw = np.full((8, 2), 0.5, np.float32)\n"
            "w = lambda *s: (0.1 * rng.standard_normal(s)).astype(np.float32)\n"
            "wg, wu, wd = w(4, 8, 16), w(4, 8, 16), w(4, 16, 8)\n"
            "out, ctx = L.forward(x, ids, rw, wg, wu, wd)\n"
            "from mok import reference\n"
            "ref = reference.forward(x, ids, rw, wg, wu, wd)\n"
            "ref = ref[0] if isinstance(ref, tuple) else ref\n"
            "err = np.linalg.norm(out - ref) / np.linalg.norm(ref)\n"
            "assert err < 1e-5, err\n"
            "c.close()\n"
            "print('installed-ok')\n")
        script = "PREFIX = %r\nSOCK = %r\n" % (os.path.join(dest, "usr/lib/python3"), sock) + script
        env = dict(os.environ, PYTHONPATH=os.path.join(dest, "usr/lib/python3/dist-packages"),
                   MOK_LIBRARY=os.path.join(dest, "usr/lib/libmok.so.1"))
        r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                           cwd=tmp, timeout=60)
        assert "installed-ok" in r.stdout, r.stdout + r.stderr
        p.send_signal(signal.SIGTERM)
        assert p.wait(10) == 0
    finally:
        if p.poll() is None:
            p.kill()
    r = make("uninstall", "DESTDIR=" + dest, "PREFIX=/usr", "SYSCONFDIR=/etc")
    assert r.returncode == 0, r.stderr
    assert not os.path.exists(os.path.join(dest, "usr/bin/mokd"))
    assert os.path.exists(os.path.join(dest, "etc/mok/mokd.conf"))  # configuration is kept


def test_mokctl_lists_sessions_and_groups(tmp):
    sys.path.insert(0, os.path.join(REPO, "client", "python"))
    import json
    import mok
    sock = os.path.join(tmp, "ctl.sock")
    p = subprocess.Popen([MOKD, "--socket", sock, "--engine", "cpu", "--log-level", "warn"])
    try:
        for _ in range(100):
            if os.path.exists(sock):
                break
            time.sleep(0.05)
        c = mok.connect(sock)
        c.group("ctl-demo", 1, 2, max_tokens=16, hidden=16, topk=2, experts=4)
        ctl = os.path.join(os.path.dirname(MOKD), "mokctl")
        st = json.loads(subprocess.run([ctl, "--socket", sock, "status", "--json"],
                                       capture_output=True, text=True, check=True).stdout)
        mine = [s for s in st["sessions"] if s["groups"]]
        assert len(mine) == 1 and mine[0]["pid"] == os.getpid(), st
        assert mine[0]["groups"][0]["rank"] == 1 and mine[0]["groups"][0]["world"] == 2
        text = subprocess.run([ctl, "--socket", sock, "status"], capture_output=True, text=True,
                              check=True).stdout
        assert "rank 1 of 2" in text, text
        metrics = subprocess.run([ctl, "--socket", sock, "metrics"], capture_output=True,
                                 text=True, check=True).stdout
        assert 'mok_group_jobs_total{session="%d",group="1",rank="1",world="2"} 0' % c.session \
            in metrics, metrics
        assert "# TYPE mok_jobs_total counter" in metrics
        assert st["groups"][0]["key"] == "ctl-demo" and st["groups"][0]["sessions"] == 1, st
        assert not st["groups"][0]["nccl"] and not st["groups"][0]["forming"], st
        c.close()
        # closed without leaving: the daemon keeps the group for a re-join
        text = subprocess.run([ctl, "--socket", sock, "status"], capture_output=True, text=True,
                              check=True).stdout
        assert "group 1 'ctl-demo' (uid %d): rank 1 of 2, on this host" % os.getuid() in text, text
        assert "lingering" in text, text
        metrics = subprocess.run([ctl, "--socket", sock, "metrics"], capture_output=True,
                                 text=True, check=True).stdout
        assert 'mok_groups{state="lingering"} 1' in metrics, metrics
        p.send_signal(signal.SIGTERM)
        assert p.wait(10) == 0
    finally:
        if p.poll() is None:
            p.kill()
