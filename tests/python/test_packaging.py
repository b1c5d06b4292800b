# SPDX-License-Identifier: Apache-2.0
"""The Python package as pip installs it (pyproject.toml, setup.py): its
version, its type hints and py.typed, and where it finds libmok. The real
pip install into a fresh venv is tests/python/ci_pip_install.sh (it needs
the package index); these run offline."""
import ctypes.util
import os
import re
import shutil
import subprocess
import sys
import typing

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = os.path.join(REPO, "client", "python")
BUILD = os.path.join(REPO, os.environ.get("MOK_BUILD") or "build")
LIBMOK = os.path.join(BUILD, "lib", "libmok.so")
sys.path.insert(0, PY)
import mok  # noqa: E402
from mok import _lib  # noqa: E402


def read(path):
    with open(os.path.join(REPO, path)) as f:
        return f.read()


def test_version_is_the_daemons():
    daemon = re.search(r'#define MOK_VERSION "([^"]+)"', read("proto/mok_version.h")).group(1)
    assert mok.__version__ == daemon


def test_pyproject_names_the_package_and_its_files():
    text = read("pyproject.toml")
    assert re.search(r'^name = "mokd-client"$', text, re.M)
    assert re.search(r'^license = "Apache-2.0"$', text, re.M)
    assert 'package-dir = {"" = "client/python"}' in text
    assert 'packages = ["mok"]' in text
    assert 'mok = ["py.typed"]' in text
    assert 'dynamic = ["version"]' in text  # setup.py reads proto/mok_version.h
    assert "proto\", \"mok_version.h\"" in read("setup.py")
    assert 'ml_dtypes' in text  # the bf16 extra
    assert os.path.isfile(os.path.join(PY, "mok", "py.typed"))
    assert "BUNDLED = \"%s\"" % _lib.BUNDLED_NAME in read("setup.py")
    manifest = read("MANIFEST.in")
    for need in ("graft proto", "graft client/src", "graft client/include", "Makefile", "LICENSE"):
        assert need in manifest, need


def public_callables():
    yield mok.connect
    yield mok.to_bf16
    yield mok.from_bf16
    yield mok.bf16_dtype
    yield mok.library_path
    yield mok.Error.__init__
    for cls in (mok.Client, mok.Layer, mok.Group, mok.Context):
        for name, f in vars(cls).items():
            if callable(f) and (not name.startswith("_") or name == "__init__"):
                yield f
            elif isinstance(f, property):
                yield f.fget


def test_public_api_is_typed():
    missing = []
    for f in public_callables():
        hints = typing.get_type_hints(f)  # resolves every annotation (no stale names)
        code = f.__code__
        args = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
        for a in args:
            if a != "self" and a not in hints:
                missing.append("%s(%s)" % (f.__qualname__, a))
        if "return" not in hints:
            missing.append("%s -> ?" % f.__qualname__)
    assert not missing, "without type hints: " + ", ".join(missing)
    assert typing.get_type_hints(mok.Grads)["d_s_gate"] == typing.Optional[mok.Result]
    assert typing.get_type_hints(mok.Layer.forward)["return"] == \
        typing.Tuple[mok.Result, mok.Context]


def test_torch_moe_signature_is_typed():
    torch = pytest.importorskip("torch")
    import mok.torch as mt
    hints = typing.get_type_hints(mt.MoE.__init__)
    for a in ("hidden", "intermediate", "experts", "topk", "shared_intermediate", "client",
              "group", "max_tokens", "return"):
        assert a in hints, a
    assert typing.get_type_hints(mt.MoE.forward)["return"] is torch.Tensor


def candidates_of(pkg_parent, env=None):
    code = "import mok._lib as L; print('\\n'.join(L._candidates()))"
    e = dict(os.environ, PYTHONPATH=pkg_parent)
    e.pop("MOK_LIBRARY", None)
    e.update(env or {})
    r = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True,
                       timeout=60, cwd="/")
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


def test_source_tree_uses_its_build_then_a_bundled_copy():
    got = candidates_of(PY)
    assert got[0] == os.path.join(REPO, "build", "lib", "libmok.so")
    assert got[1] == os.path.join(PY, "mok", "libmok.so")
    assert candidates_of(PY, {"MOK_LIBRARY": "/x/libmok.so"}) == ["/x/libmok.so"]


def test_installed_copy_finds_the_bundled_library(tmp_path):
    if not os.path.exists(LIBMOK):
        pytest.skip("libmok is not built")
    site = tmp_path / "site-packages"
    shutil.copytree(os.path.join(PY, "mok"), str(site / "mok"),
                    ignore=shutil.ignore_patterns("__pycache__", "libmok.so"))
    bundled = str(site / "mok" / "libmok.so")
    got = candidates_of(str(site))
    assert got[0] == bundled  # no source tree around it: no build/ guess first
    assert all("build/lib" not in c for c in got)
    shutil.copy(LIBMOK, bundled)
    e = dict(os.environ, PYTHONPATH=str(site))
    e.pop("MOK_LIBRARY", None)
    r = subprocess.run([sys.executable, "-c", "import mok; print(mok.library_path()); "
                        "print(mok._lib.lib().mok_status_name(5).decode())"],
                       env=e, capture_output=True, text=True, timeout=60, cwd="/")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [bundled, "ELIMIT"]
    # a bundled file that is no library: the error names what was tried
    with open(bundled, "w") as f:
        f.write("not an ELF file")
    r = subprocess.run([sys.executable, "-c", "import mok\ntry:\n    mok.library_path()\n"
                        "except mok.Error as e:\n    print(e.status, e.message)"],
                       env=dict(e, LD_LIBRARY_PATH="/nonexistent"), capture_output=True,
                       text=True, timeout=60, cwd="/")
    assert r.returncode == 0, r.stderr
    if "ENOENT" in r.stdout:  # no system libmok either
        assert bundled in r.stdout and "pip install" in r.stdout, r.stdout
    else:  # a libmok is installed system-wide (make install): that one loads
        assert ctypes.util.find_library("mok"), r.stdout
