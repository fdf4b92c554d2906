"""The package's structure, read from its source: no import cycle among its modules (imports at the top and inside
functions alike), and every public top-level name defined in one module only."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("peft_bitune", "trl_integration", "vllm_integration")
# Names that several modules define on purpose: each command-line module's entry point, each module's own logger.
SHARED_BY_DESIGN = {"main", "logger"}


def package_modules() -> dict[str, Path]:
    """Every module of the packages, by dotted name (a package by the name of its `__init__.py`)."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules that module `name` imports anywhere in its source. `from X import y` imports the module
    `X.y` if there is one, else `X`; the parent packages Python imports on the way are not counted (they are not the
    module's own choice, and every submodule would otherwise import its package's `__init__`)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    imported = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
            source = ".".join(part for part in (base, node.module or "") if part)
            targets = [
                f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source for alias in node.names
            ]
        else:
            continue
        imported.update(target for target in targets if target in modules and target != name)
    return imported


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` (its modules in order, the first repeated at the end), or `None`."""
    done, path = set(), []

    def visit(module: str) -> list[str] | None:
        if module in path:
            return path[path.index(module) :] + [module]
        if module in done:
            return None
        path.append(module)
        for imported in sorted(graph.get(module, ())):
            cycle = visit(imported)
            if cycle:
                return cycle
        path.pop()
        done.add(module)
        return None

    for module in sorted(graph):
        cycle = visit(module)
        if cycle:
            return cycle
    return None


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_import_graph_sees_imports_at_the_top_and_inside_functions():
    graph = import_graph()
    assert "peft_bitune.constants" in graph["peft_bitune.tuner.model"]  # `from ..constants import (...)`
    assert "peft_bitune.compat" in graph["peft_bitune.tuner.passes"]  # `from .. import compat`
    assert "trl_integration.trainer" in graph["trl_integration.cli"]  # imported inside a function
    assert "peft_bitune" in graph["trl_integration.trainer"]  # `from peft_bitune import ...`: the package itself


def test_the_packages_have_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, f"Import cycle: {' -> '.join(cycle)}. Move what both sides need to a lower module."


def test_the_shared_names_import_nothing_from_the_package():
    assert import_graph()["peft_bitune.constants"] == set()


def test_every_public_top_level_name_is_defined_once():
    defined = defaultdict(list)
    for name, path in package_modules().items():
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names = [node.name]
            elif isinstance(node, ast.Assign):
                names = [target.id for target in node.targets if isinstance(target, ast.Name)]
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names = [node.target.id]
            else:
                continue
            for defined_name in names:
                if not defined_name.startswith("_") and defined_name not in SHARED_BY_DESIGN:
                    defined[defined_name].append(name)
    twice = {name: modules for name, modules in defined.items() if len(modules) > 1}
    assert not twice, f"Defined in more than one module (define each once, import it elsewhere): {twice}"


# ------------------------------------------------------------------------------------------------- the layout
# The homes around the method, which it never imports (directly or through another module).
AROUND_THE_METHOD = ("serving", "evaluation", "visualize", "training")


def reachable_from(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module `start` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for imported in graph.get(todo.pop(), ()):
            if imported not in seen:
                seen.add(imported)
                todo.append(imported)
    return seen


def test_reachable_from_follows_imports_through_other_modules():
    assert reachable_from({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"a"}}, "a") == {"b", "c"}


def test_the_method_never_imports_the_homes_around_it():
    graph = import_graph()
    method = [name for name in graph if name.startswith("peft_bitune.tuner")]
    assert "peft_bitune.tuner.model" in method and "peft_bitune.tuner.passes" in method
    around = tuple(f"peft_bitune.{home}" for home in AROUND_THE_METHOD)
    arrows = {
        name: sorted(target for target in reachable_from(graph, name) if target.startswith(around))
        for name in method
    }
    arrows = {name: targets for name, targets in arrows.items() if targets}
    assert not arrows, f"The method imports what is built around it: {arrows}. Move what both need into the method."


def test_persistence_and_utilities_never_import_the_method():
    """Persistence (the hooks the tuner calls) and the utilities sit below the method."""
    graph = import_graph()
    below = [name for name in graph if name.startswith(("peft_bitune.persistence", "peft_bitune.utils"))]
    assert "peft_bitune.persistence.checkpoint_keys" in below and "peft_bitune.utils.base_model" in below
    arrows = {
        name: sorted(t for t in reachable_from(graph, name) if t.startswith("peft_bitune.tuner") or t == "peft_bitune")
        for name in below
    }
    arrows = {name: targets for name, targets in arrows.items() if targets}
    assert not arrows, f"These import the method: {arrows}."


def test_the_top_of_the_package_holds_at_most_ten_modules():
    top = sorted(path.name for path in (ROOT / "peft_bitune").glob("*.py"))
    assert len(top) <= 10, f"peft_bitune/ holds {len(top)} modules at its top: {top}. Give new ones a home below."


def test_the_tuner_is_one_class():
    """`BituneModel`'s methods are its own: no mixin class sits between it and PEFT's `BaseTuner`."""
    from peft.tuners.tuners_utils import BaseTuner

    from peft_bitune import BituneModel

    assert BituneModel.__bases__ == (BaseTuner,)


def test_the_module_map_of_the_docs_names_every_module():
    """Every module of the method and of the packages around it is named by its path (`tuner/model.py`); serving
    and evaluation, which have their own pages, by their folder (`serving/`)."""
    text = (ROOT / "docs" / "how-it-works.md").read_text(encoding="utf-8")
    module_map = text.split("## Where it lives in the code", 1)[1]
    named = set(re.findall(r"`([\w/]+(?:\.py|/))`", module_map))
    package = ROOT / "peft_bitune"
    modules = set()
    for path in package.rglob("*.py"):
        relative = path.relative_to(package)
        if relative.parts[0] in ("serving", "evaluation"):
            modules.add(f"{relative.parts[0]}/")
        elif path.name != "__init__.py":
            modules.add(relative.as_posix())
    modules |= {f"{path.parent.name}/" for path in package.glob("*/__init__.py")}
    stale = sorted(name for name in named - modules if name.endswith(".py"))
    missing = sorted(modules - named)
    assert not missing and not stale, f"docs/how-it-works.md's module map: add {missing}, remove {stale}."
