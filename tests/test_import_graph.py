"""trajgen's modules form no import circle, counting imports inside functions, and a local run loads no
optional backend: a circle hidden by a late import is still a circle to the next reader."""
import ast
import graphlib
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "trajgen"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """The trajgen modules one import statement names, relative imports resolved."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        base = module.split(".")
        base = base[: len(base) - node.level + (1 if is_package else 0)]
        stem = ".".join(base + ([node.module] if node.module else []))
    else:
        stem = node.module or ""
    return [stem] + [f"{stem}.{alias.name}" for alias in node.names]


def import_graph() -> dict[str, set[str]]:
    """Each trajgen module and the trajgen modules it imports anywhere in its body."""
    files = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {module: set() for module in files}
    for module, path in files.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            graph[module].update(name for name in _imported(node, module, path.name == "__init__.py")
                                 if name in files and name != module)
    return graph


def test_the_graph_sees_imports_inside_functions():
    graph = import_graph()
    assert sum(map(len, graph.values())) > 100
    assert "trajgen.run" in graph["trajgen.modes"]


def test_no_module_imports_itself_back():
    try:
        graphlib.TopologicalSorter(import_graph()).prepare()
    except graphlib.CycleError as circle:
        raise AssertionError("import circle: " + " -> ".join(circle.args[1])) from None


def test_a_local_run_imports_no_optional_backend():
    probe = ("import sys, trajgen.run, trajgen.worker, trajgen.options\n"
             "print(sorted({name.split('.')[0] for name in sys.modules}))")
    loaded = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert "trajgen" in loaded.stdout
    for backend in ("docker", "modal", "ray", "playwright", "mcp"):
        assert f"'{backend}'" not in loaded.stdout
