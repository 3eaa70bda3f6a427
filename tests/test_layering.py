"""Dependencies run one way: kernels <- artifacts <- calib, backends <- the
top (plugin, hooks, cli, report). No module imports from a layer above its
own, and calib and backends do not import each other."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "vllm_kvq"
LAYERS = {"kernels": 0, "artifacts": 1, "calib": 2, "backends": 2}
TOP = 3


def layer(module: str) -> tuple[int, str]:
    """(layer, part) of ``vllm_kvq.<part>...``."""
    part = module.split(".")[1] if "." in module else ""
    return LAYERS.get(part, TOP), part


def imports(path: Path) -> set[str]:
    """Every ``vllm_kvq`` module a file imports, at any depth of its code."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("vllm_kvq"):
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("vllm_kvq"))
    return out


def violations() -> list[str]:
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(("vllm_kvq", *path.relative_to(PACKAGE).with_suffix("").parts))
        own, part = layer(module)
        for target in imports(path):
            other, other_part = layer(target)
            if other > own or (own == other == 2 and part != other_part):
                bad.append(f"{module} imports {target}")
    return sorted(bad)


def test_no_module_imports_from_a_layer_above_its_own():
    assert sorted(violations()) == []


def test_the_check_sees_a_violation(tmp_path, monkeypatch):
    """The check itself: a kernel module importing the artifacts is caught."""
    fake = tmp_path / "vllm_kvq"
    (fake / "kernels").mkdir(parents=True)
    (fake / "kernels" / "bad.py").write_text("def f():\n    from vllm_kvq.artifacts import oscar\n")
    (fake / "calib").mkdir()
    (fake / "calib" / "x.py").write_text("import vllm_kvq.backends.settings\n")
    import sys

    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    assert sorted(violations()) == ["vllm_kvq.calib.x imports vllm_kvq.backends.settings",
                            "vllm_kvq.kernels.bad imports vllm_kvq.artifacts",
                            "vllm_kvq.kernels.bad imports vllm_kvq.artifacts.oscar"]
