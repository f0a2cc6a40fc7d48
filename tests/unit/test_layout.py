"""The library never imports the CLI/report stack (STYLE: mlxb/ never imports typer, rich, pyarrow)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = {"typer", "rich", "pyarrow"}


def test_library_imports_no_cli_stack():
    bad = []
    for path in (ROOT / "mlxb").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for n in names:
                if n.split(".")[0] in FORBIDDEN or n.startswith("mlxb.commands"):
                    bad.append(f"{path.relative_to(ROOT)}: {n}")
    assert not bad, bad
