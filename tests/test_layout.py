"""The house rules of the package, read from its source: what may import what, where internals live, function size.

Each rule is checked on the code as written (its syntax tree), so a lazy import inside a function counts
as much as one at the top of a module.
"""

from __future__ import annotations

import ast
import pathlib
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "lightning_dltune"
ROOT = "lightning_dltune"
TORCH_INTERNALS = f"{ROOT}.loaders.torch_internals"
LIGHTNING_INTERNALS = f"{ROOT}.measure.lightning_internals"
MAX_FUNCTION_LINES = 60  # the body, docstring left out


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
TREES = {name: ast.parse(path.read_text(), filename=str(path)) for name, path in MODULES.items()}


def _imports(name: str) -> set[str]:
    """Every module ``name`` imports, a ``from package import module`` resolved to the module."""
    found = set()
    for node in ast.walk(TREES[name]):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            submodules = {f"{node.module}.{alias.name}" for alias in node.names} & set(MODULES)
            found |= submodules or {node.module}  # `from package import module` imports the module
    return found - {"__future__"}


def _own(imports: set[str]) -> set[str]:
    return {m for m in imports if m in MODULES}


def _reachable(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for dep in _own(_imports(todo.pop())) - seen:
            seen.add(dep)
            todo.append(dep)
    return seen


CORE = sorted(m for m in MODULES if m == f"{ROOT}.core" or m.startswith(f"{ROOT}.core."))


@pytest.mark.parametrize("module", CORE)
def test_core_imports_only_the_standard_library_and_core_itself_transitively(module):
    reached = {module} | _reachable(module)
    outside_core = sorted(m for m in reached if not m.startswith(f"{ROOT}.core"))
    assert not outside_core, f"{module} reaches {outside_core}"
    foreign = sorted(
        m
        for r in reached
        for m in _imports(r)
        if not m.startswith(ROOT) and m.split(".")[0] not in sys.stdlib_module_names
    )
    assert not foreign, f"{module} (or a core module it imports) imports {foreign}: core is standard library only"


def test_no_import_cycle():
    cycles = sorted(m for m in MODULES if m in _reachable(m))
    assert not cycles, f"modules that import themselves through others: {cycles}"


def _private_paths(name: str) -> list[str]:
    return sorted(
        m for m in _imports(name) if not m.startswith(ROOT) and any(part.startswith("_") for part in m.split(".")[1:])
    )


def _private_attributes(name: str) -> set[str]:
    """``obj._name`` reads and writes of objects other than ``self`` / ``cls``."""
    found = set()
    for node in ast.walk(TREES[name]):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.add(node.attr)
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr")
        ):
            if (
                len(node.args) > 1
                and isinstance(node.args[1], ast.Constant)
                and str(node.args[1].value).startswith("_")
            ):
                found.add(node.args[1].value)
    return found


def _internal_names() -> set[str]:
    return _private_attributes(TORCH_INTERNALS) | _private_attributes(LIGHTNING_INTERNALS)


@pytest.mark.parametrize("module", sorted(set(MODULES) - {TORCH_INTERNALS, LIGHTNING_INTERNALS}))
def test_torch_and_lightning_internals_live_in_their_one_module_each(module):
    assert not _private_paths(module), f"{module} imports private modules {_private_paths(module)}"
    lightning_private = sorted(
        m for m in _imports(module) if m.startswith(("lightning.pytorch.loops", "lightning.pytorch.trainer.connectors"))
    )
    assert not lightning_private, f"{module} imports Lightning's loops or connectors: {lightning_private}"
    own = {
        n for node in ast.walk(TREES[module]) if isinstance(node, (ast.FunctionDef, ast.ClassDef)) for n in [node.name]
    }
    leaked = sorted((_private_attributes(module) & _internal_names()) - own - _own_attributes(module))
    assert not leaked, f"{module} touches {leaked}, internals that belong in {TORCH_INTERNALS} or {LIGHTNING_INTERNALS}"


def _own_attributes(name: str) -> set[str]:
    """Private attributes this module sets on ``self`` (its own state, not an internal of torch or Lightning)."""
    return {
        node.attr
        for node in ast.walk(TREES[name])
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
    }


def _long_functions(tree: ast.AST, limit: int) -> list[tuple[str, int]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            has_doc = isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant)
            first = body[1] if has_doc and len(body) > 1 else body[0]
            lines = node.end_lineno - first.lineno + 1
            if lines > limit:
                out.append((node.name, lines))
    return out


def test_no_function_in_the_package_is_longer_than_a_screen():
    long = {name: found for name in MODULES if (found := _long_functions(TREES[name], MAX_FUNCTION_LINES))}
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_the_public_names_and_class_paths_users_wrote_still_import():
    import lightning_dltune
    from lightning_dltune.callback import DataLoaderTuner
    from lightning_dltune.cli import main
    from lightning_dltune.datamodule import TunableDataModule

    assert (
        lightning_dltune.DataLoaderTuner is DataLoaderTuner and lightning_dltune.TunableDataModule is TunableDataModule
    )
    assert callable(main) and lightning_dltune.LoaderConfig.__module__ == f"{ROOT}.core.config"
