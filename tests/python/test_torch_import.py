# SPDX-License-Identifier: Apache-2.0
"""mok.torch without a GPU: `import mok` never imports torch, `import mok.torch` works
without PyTorch and says so (ImportError) only when a name of it is used."""
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = os.path.join(REPO, "client", "python")


def run(code):
    env = dict(os.environ, PYTHONPATH=PY)
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_import_mok_does_not_import_torch():
    out = run("import sys, mok, mok.torch; print('torch' in sys.modules)")
    assert out.strip() == "False"


def test_mok_torch_without_torch_raises_on_use():
    # hide torch whether or not it is installed: a None entry makes `import torch` fail
    out = run("import sys; sys.modules['torch'] = None\n"
              "import mok.torch as mt\n"
              "assert 'MoE' in dir(mt)\n"
              "try:\n"
              "    mt.MoE\n"
              "except ImportError as e:\n"
              "    print('ImportError', e)\n")
    assert out.startswith("ImportError mok.torch needs PyTorch"), out


def test_unknown_name_is_attribute_error():
    out = run("import sys; sys.modules['torch'] = None\n"
              "import mok.torch as mt\n"
              "try:\n"
              "    mt.nope\n"
              "except AttributeError as e:\n"
              "    print('AttributeError', e)\n")
    assert out.startswith("AttributeError"), out


def test_mok_distributed_without_torch():
    # importing it never imports torch; join says what is missing
    out = run("import sys; sys.modules['torch'] = None\n"
              "import mok.distributed as md\n"
              "try:\n"
              "    md.join(None, max_tokens=8, hidden=8, topk=1, experts=2)\n"
              "except ImportError as e:\n"
              "    print('ImportError', e)\n")
    assert out.startswith("ImportError mok.distributed needs PyTorch"), out
    out = run("import sys, mok.distributed; print('torch' in sys.modules)")
    assert out.strip() == "False"
