"""The house rules of the code's layout: the addon's folders depend one way, top to
bottom, and no module of the project imports itself back through others."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# From the top (what people and mitmproxy see) to the bottom (the wire formats): a
# folder imports only folders below it.
LAYERS = ["surface", "answer", "handoff", "servers", "formats"]
PACKAGES = ["addon", "watchers", "scripts"]


def module_of(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, known: set[str]) -> set[str]:
    """The project modules `path` imports anywhere in it (in functions and
    TYPE_CHECKING blocks too: they tie the design all the same)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in known}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                if f"{node.module}.{alias.name}" in known:
                    found.add(f"{node.module}.{alias.name}")
                elif node.module in known:
                    found.add(node.module)
    return found


def graph() -> dict[str, set[str]]:
    files = {module_of(p): p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")}
    return {name: imported(path, set(files)) - {name} for name, path in files.items()}


def layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "addon" or len(parts) < 3:
        return None
    return LAYERS.index(parts[1]) if parts[1] in LAYERS else None


def test_every_addon_module_lives_in_a_layer_folder_with_its_purpose_on_top():
    for path in (REPO / "addon").rglob("*.py"):
        relative = path.relative_to(REPO / "addon")
        if relative.parts in {("__init__.py",), ("spillover.py",)}:
            continue
        assert relative.parts[0] in LAYERS, f"addon/{relative} is in no layer folder"
    for name in LAYERS:
        purpose = ast.get_docstring(ast.parse((REPO / "addon" / name / "__init__.py").read_text()))
        assert purpose and "\n" not in purpose, f"addon/{name}/__init__.py: one line of purpose"


def test_no_addon_folder_imports_one_above_it():
    upward = [
        f"{module} -> {target}"
        for module, targets in graph().items()
        for target in targets
        if (here := layer(module)) is not None
        and (there := layer(target)) is not None
        and there < here
    ]
    assert upward == []


def test_nothing_below_the_addon_imports_it():
    wrong = [
        f"{module} -> {target}"
        for module, targets in graph().items()
        if module.startswith("watchers")
        for target in targets
        if target.startswith(("addon", "scripts"))
    ]
    assert wrong == []


def test_no_import_circles():
    edges = graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in edges[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in edges:
        if node not in index:
            visit(node)
    assert circles == []


def test_the_scripts_top_holds_only_what_a_person_runs():
    top = {p.name for p in (REPO / "scripts").iterdir() if p.is_file()}
    assert not {name for name in top if name.startswith(("bench_", "gpu_"))}
    for name in sorted(top - {"__init__.py"}):
        text = (REPO / "scripts" / name).read_text()
        runnable = '__name__ == "__main__"' in text or text.startswith("#!")
        assert runnable, f"scripts/{name} is not something a person runs"
