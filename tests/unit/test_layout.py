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


PACKAGES = {"mlxb": "mlxb", "commands": "mlxb.commands", "oracle": "mlxb.oracle"}
LOWER = ("mlxb.cache", "mlxb.models", "mlxb.kernels")  # never reach up into the engine or its rooms
UPPER = ("mlxb.engine", "mlxb.spec", "mlxb.adapters", "mlxb.distributed", "mlxb.constrain", "mlxb.server",
         "mlxb.bench", "mlxb.parity", "mlxb.commands")


def _module_graph() -> dict:
    """Every module of mlxb/, commands/ and oracle/ -> the project modules it imports (lazy imports included)."""
    files = {}
    for top, pkg in PACKAGES.items():
        for path in (ROOT / top).rglob("*.py"):
            rel = path.relative_to(ROOT / top).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            files[".".join([pkg, *parts])] = path
    graph = {}
    for name, path in files.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                deps |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module
                         for a in node.names}
        graph[name] = {d for d in deps if d in files and d != name}
    return graph


def _cycles(graph: dict) -> list:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_two_modules_import_each_other():
    assert _cycles(_module_graph()) == []


def test_cycle_finder_sees_a_planted_cycle():
    graph = _module_graph()
    assert "mlxb.cache.prefix" in graph["mlxb.cache.prompt_cache"]
    graph["mlxb.cache.prefix"] = graph["mlxb.cache.prefix"] | {"mlxb.cache.prompt_cache"}
    assert any({"mlxb.cache.prefix", "mlxb.cache.prompt_cache"} <= set(c) for c in _cycles(graph))


def test_lower_layers_never_import_the_engine():
    bad = [f"{m} -> {d}" for m, deps in _module_graph().items() if m.startswith(LOWER)
           for d in deps if d.startswith(UPPER)]
    assert not bad, bad


def test_engine_room_holds_the_loop_only():
    """Speculation, adapters, tensor parallel and constrained decoding live in their own packages."""
    names = {p.stem for p in (ROOT / "mlxb" / "engine").glob("*.py")}
    assert not {n for n in names if n.startswith(("spec", "tp", "lora", "draft", "grammar", "tools"))}
