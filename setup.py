# SPDX-License-Identifier: Apache-2.0
"""The build step of the mokd-client package (metadata: pyproject.toml).

build_py copies client/python/mok, then puts libmok.so beside it as
mok/libmok.so, where mok/_lib.py looks for it:
  * MOKD_CLIENT_LIBMOK=/path/to/libmok.so: that library, as it is;
  * else `make` builds it from client/src and proto/ in a build folder of
    setuptools' own (build/python/...), with the CUDA parts off (libmok opens
    the CUDA driver at run time; it never links CUDA).
An editable install (pip install -e .) uses the source tree's mok, which
finds build/lib/libmok.so: there the step runs `make build/lib/libmok.so`.
The wheel is tagged for this platform (it holds a native library) but for
any Python 3: the library is plain C, called through ctypes.
"""
import os
import re
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1
    from wheel.bdist_wheel import bdist_wheel

ROOT = os.path.dirname(os.path.abspath(__file__))
LIB_ENV = "MOKD_CLIENT_LIBMOK"
BUNDLED = "libmok.so"  # mok/_lib.py BUNDLED_NAME
NEEDS = ("make, a C compiler, protoc-c and the protobuf-c headers (Debian: build-essential "
         "protobuf-c-compiler libprotobuf-c-dev; deploy/setup.sh installs them)")


def make_libmok(build_dir):
    """Builds BUILD/lib/libmok.so with the project's Makefile; returns its path."""
    if not shutil.which("make"):
        raise SystemExit("mokd-client: building libmok.so needs %s; or set %s to a built "
                         "libmok.so" % (NEEDS, LIB_ENV))
    env = dict(os.environ, NVCC="")
    target = os.path.join(build_dir, "lib", "libmok.so")
    cmd = ["make", "--no-print-directory", "-C", ROOT, "BUILD=" + build_dir, "NVCC=",
           "-j%d" % max(1, min(8, os.cpu_count() or 1)), target]
    print("mokd-client: " + " ".join(cmd), flush=True)
    r = subprocess.run(cmd, env=env)
    if r.returncode != 0 or not os.path.isfile(target):
        raise SystemExit("mokd-client: `%s` failed (status %d): building libmok.so needs %s; "
                         "or set %s to a built libmok.so" % (" ".join(cmd), r.returncode, NEEDS,
                                                             LIB_ENV))
    return target


class BuildPyWithLibmok(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            make_libmok(os.path.join(ROOT, "build"))  # the source tree's own build
            return
        given = os.environ.get(LIB_ENV)
        if given:
            if not os.path.isfile(given):
                raise SystemExit("mokd-client: %s=%s is no file" % (LIB_ENV, given))
            lib = given
        else:
            temp = self.get_finalized_command("build").build_temp
            lib = make_libmok(os.path.abspath(os.path.join(temp, "libmok")))
        dest = os.path.join(self.build_lib, "mok", BUNDLED)
        self.mkpath(os.path.dirname(dest))
        self.copy_file(lib, dest, preserve_mode=False)
        os.chmod(dest, 0o755)

    def get_outputs(self, include_bytecode=1):
        outs = super().get_outputs(include_bytecode)
        if not getattr(self, "editable_mode", False):
            outs.append(os.path.join(self.build_lib, "mok", BUNDLED))
        return outs


class PlatformWheel(bdist_wheel):
    def finalize_options(self):
        super().finalize_options()
        self.root_is_pure = False  # a native library inside

    def get_tag(self):
        _, _, plat = super().get_tag()
        return "py3", "none", plat


def project_version():
    """The one version of mok (proto/mok_version.h), which libmok, mokd and mokctl report."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "proto", "mok_version.h")
    with open(path) as f:
        m = re.search(r'^#define MOK_VERSION "([^"]+)"$', f.read(), re.M)
    if not m:
        raise RuntimeError("proto/mok_version.h defines no MOK_VERSION")
    return m.group(1)


setup(
    version=project_version(),
    cmdclass={"build_py": BuildPyWithLibmok, "bdist_wheel": PlatformWheel},
    # setuptools' build folder apart from the Makefile's build/lib, build/bin
    options={"build": {"build_base": os.path.join("build", "python")}},
)
