"""The architecture's layering, checked on the source: the model files know no backend and no layout
code, and a mesh is pure data."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1] / "rlflow"
BACKEND_WORDS = ("cpu_kernels", "torch_npu", "ctypes", "backends", "npu_", "data_ptr")


def _imports(path: pathlib.Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            out += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return out


def test_model_files_import_no_backend_and_no_layout_code():
    files = sorted((ROOT / "models").glob("*.py"))
    assert len(files) >= 5, files
    bad = []
    for f in files:
        for mod in _imports(f):
            # the ops package's public names only: no kernel module, no parallel code
            if mod.startswith(("rlflow.ops.", "rlflow.parallel", "torch_npu", "ctypes", "torch.distributed")) \
                    and mod.split(".")[-1] not in _public_ops():
                bad.append(f"{f.name} imports {mod}")
        text = f.read_text()
        bad += [f"{f.name} names {w!r}" for w in BACKEND_WORDS if w in text]
    assert not bad, "\n".join(bad)


def _public_ops() -> set[str]:
    import rlflow.ops
    return set(rlflow.ops.__all__)


def test_the_check_sees_a_planted_import(tmp_path, monkeypatch):
    (tmp_path / "models").mkdir()
    for i in range(5):
        (tmp_path / "models" / f"m{i}.py").write_text("import torch\n")
    (tmp_path / "models" / "m0.py").write_text("from rlflow.ops import cpu_kernels\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    try:
        test_model_files_import_no_backend_and_no_layout_code()
    except AssertionError as e:
        assert "cpu_kernels" in str(e)
    else:
        raise AssertionError("a model file importing a kernel module passed the check")


def test_a_mesh_is_pure_data():
    """Importing the mesh pulls in neither torch.distributed's executor nor the planner (the import cycle
    mesh -> dist -> plan -> cli -> models.sharding -> mesh is cut)."""
    code = ("import sys, rlflow.sharding.mesh; "
            "print(sorted(m for m in sys.modules if m.startswith('rlflow.sharding.') or m == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['rlflow.sharding.mesh']", out
