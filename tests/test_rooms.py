"""The package's rooms and their imports, read from the sources (every import, those inside functions too): no import
circle between the package's modules, and the rooms below generation/ (the model, its modules, the math, the CPU and
GPU runtimes, the kernels' choice, the options) import nothing of it: the generation side registers what it needs
(models/rfa_transformer.py's MODEL_BUILT_HOOKS)."""
import ast
import pathlib
from typing import Dict, List, Set

import rfa_fairseq

PACKAGE = pathlib.Path(rfa_fairseq.__file__).parent
BELOW_GENERATION = ("models", "modules", "ops", "cpu", "gpu", "kernel_choice", "config")


def package_imports() -> Dict[str, Set[str]]:
    """{module: the package's modules it imports} ("rfa_fairseq.x.y"; a package by its own name)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    imports = {}
    for name, (path, is_package) in modules.items():
        here = name.split(".") if is_package else name.split(".")[:-1]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                base = ".".join(here[: len(here) - node.level + 1] + [node.module or ""] if node.level else
                                [node.module or ""]).rstrip(".")
                found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
        imports[name] = {m for m in found if m in modules and m != name}
    return imports


def circles(imports: Dict[str, Set[str]]) -> List[List[str]]:
    """The groups of modules that import each other, directly or not (Tarjan's strongly connected components)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    found: List[List[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in imports[module]:
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            group = stack[stack.index(module):]
            del stack[stack.index(module):]
            if len(group) > 1:
                found.append(sorted(group))

    for module in imports:
        if module not in index:
            visit(module)
    return found


def test_no_import_circle_between_the_packages_modules():
    imports = package_imports()
    assert "rfa_fairseq.generation.static_beam_search" in imports["rfa_fairseq.generation.batch_groups"]
    assert circles(imports) == []
    # the check finds a circle where there is one
    imports["rfa_fairseq.generation.static_beam_search"].add("rfa_fairseq.generation.batch_groups")
    assert circles(imports) == [["rfa_fairseq.generation.batch_groups", "rfa_fairseq.generation.static_beam_search"]]


def test_the_rooms_below_generation_import_nothing_of_it():
    below = [f"rfa_fairseq.{room}" for room in BELOW_GENERATION]
    upward = {module: sorted(m for m in targets if m.startswith("rfa_fairseq.generation"))
              for module, targets in package_imports().items()
              if any(module == b or module.startswith(b + ".") for b in below)}
    assert "rfa_fairseq.models.rfa_transformer" in upward
    assert {module: targets for module, targets in upward.items() if targets} == {}
