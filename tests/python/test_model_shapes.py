# SPDX-License-Identifier: Apache-2.0
"""The benchmark model shapes have one definition, tests/harness/model_shapes.h;
the Python benches' copies (tests/bench/torch_baseline.py, global experts;
tests/gpu/v3_summary.py, one GPU's slice) must say the same."""
import ast
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def read(*parts):
    with open(os.path.join(REPO, *parts)) as f:
        return f.read()


def header_shapes():
    text = read("tests", "harness", "model_shapes.h")
    rows = re.findall(r'X\("([^"]+)", (\d+), (\d+), (\d+), (\d+)\)', text)
    ep = int(re.search(r"#define MOK_MODEL_EP (\d+)", text).group(1))
    return [(n, int(e), int(h), int(i), int(k)) for n, e, h, i, k in rows], ep


def assigned(path, name):
    """The literal value a module assigns to name (read, not imported: the
    benches import torch)."""
    for node in ast.parse(read(*path)).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("%s assigns no %s" % ("/".join(path), name))


def test_the_header_has_the_four_shapes():
    shapes, ep = header_shapes()
    assert [s[0] for s in shapes] == ["kimi-k2.7", "glm-5.2", "qwen3.5-397b", "deepseek-v4-pro"]
    assert ep == 8 and all(s[1] % ep == 0 for s in shapes)


def test_torch_baseline_matches_the_header():
    shapes, ep = header_shapes()
    path = ("tests", "bench", "torch_baseline.py")
    assert [tuple(s) for s in assigned(path, "SHAPES")] == shapes
    assert assigned(path, "EP") == ep


def test_v3_summary_matches_the_header():
    shapes, ep = header_shapes()
    want = {n: (e // ep, h, i, k) for n, e, h, i, k in shapes}
    assert assigned(("tests", "gpu", "v3_summary.py"), "SHAPES") == want
