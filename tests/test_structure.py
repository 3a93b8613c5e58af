"""The package's structure: the core's constants declared once, the op table
checked against them, no import circle, and no wiring outside the boot.

These read the package's own source (ast), so a later change that copies a
constant, hides an import circle in a function, or registers something at
import time fails here.
"""
from __future__ import annotations

import ast
import pathlib
import re

import pytest

import fastlazy
from fastlazy import _core, optable, patching
from fastlazy._core import Category, Form, OpFlag, Rule

PACKAGE = pathlib.Path(fastlazy.__file__).parent
MODULES = sorted(p for p in PACKAGE.rglob("*.py"))


def _module_name(path):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_every_row_names_the_cores_constants():
    flag_mask = 0
    for flag in OpFlag:
        flag_mask |= flag
    cat_mask = 0
    for cat in Category:
        cat_mask |= cat
    assert len(optable.OPS) < _core.GENERIC_OP <= _core.MAX_OPS - 1
    for opcode, row in enumerate(optable.OPS):
        assert row.opcode == opcode
        assert row.rule in set(Rule) and row.rule != Rule.R_COUNT, row.name
        assert row.flags & ~flag_mask == 0, row.name
        assert row.cats and row.cats & ~cat_mask == 0, row.name
        assert len(row.params) <= _core.MAX_PARAMS, row.name
        assert (row.lower is None) == (row.rule == Rule.R_GENERIC), row.name


def test_entry_forms_are_the_cores():
    forms = {form for _, _, _, form in patching.entry_points()}
    assert forms == {Form.FORM_CALL, Form.FORM_INPLACE}
    assert (int(Form.FORM_CALL), int(Form.FORM_INPLACE)) == (0, 1)


# a name of the core's enums (R_BINARY, OPF_NO_BOOL, NODE_CAST, SLOT_TENSOR,
# ATTR_KEEPDIM, MAX_IN, GENERIC_OP, FORM_CALL...) bound to a literal number
_CORE_NAMES = {name for enum in (Rule, OpFlag, Category, Form, _core.NodeFlag,
                                 _core.ScalarType, _core.SlotKey) for name in enum.__members__}
_CORE_NAMES |= {name for name in dir(_core) if re.fullmatch(r"(ATTR|MAX|GENERIC|NDTYPES)\w*", name)}


def _number_literals(node):
    return all(isinstance(n, (ast.Constant, ast.BinOp, ast.UnaryOp, ast.Tuple, ast.operator,
                              ast.unaryop, ast.Load))
               for n in ast.walk(node)) and any(
        isinstance(n, ast.Constant) and type(n.value) is int for n in ast.walk(node))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: _module_name(p))
def test_no_core_constant_is_written_again(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign) or not _number_literals(node.value):
            continue
        names = [t.id for target in node.targets for t in ast.walk(target)
                 if isinstance(t, ast.Name)]
        copied = [n for n in names if n in _CORE_NAMES or n.lstrip("_") in _CORE_NAMES]
        assert not copied, f"{path.name}:{node.lineno} writes the core's {copied} again"


def _imports(path):
    """The fastlazy modules `path` imports anywhere (functions included)."""
    name = _module_name(path)
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("fastlazy"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".")[:len(name.split(".")) - node.level + (
                    path.name == "__init__.py")]
                base = ".".join(package + ([base] if base else []))
            if not base.startswith("fastlazy"):
                continue
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if (PACKAGE.parent / (full.replace(".", "/") + ".py")).exists()
                          or (PACKAGE.parent / full.replace(".", "/")).is_dir() else base)
    found.discard(name)
    return found


def test_no_import_circle():
    graph = {_module_name(p): _imports(p) for p in MODULES}
    # a package's __init__ is imported by its submodules' import; only its
    # own imports count as edges out of it
    state = {}

    def visit(module, path):
        state[module] = "open"
        for target in sorted(graph.get(module, ())):
            if target == "fastlazy" or target not in graph:
                continue
            if state.get(target) == "open":
                cycle = path[path.index(target):] + [target]
                raise AssertionError("import circle: " + " -> ".join(cycle))
            if target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


# calls that wire one module to another, and so belong to the boot
_WIRING = re.compile(r"^(_core\.(install|register_op|set_\w+|make_\w+)|\w*\.?register\w*|"
                     r"\w*\.?install\w*|\w*\.?set_backend)$")


@pytest.mark.parametrize("path", [p for p in MODULES if p.name not in ("boot.py",)],
                         ids=lambda p: _module_name(p))
def test_no_wiring_at_import(path):
    """Module-level code does not call into other modules to register or
    install anything: that is the boot's job (fastlazy/boot.py)."""
    tree = ast.parse(path.read_text())
    for stmt in tree.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for node in ast.walk(stmt):
            if isinstance(node, ast.Call):
                callee = ast.unparse(node.func)
                if path.name == "__init__.py" and callee == "_boot.boot":
                    continue
                assert not _WIRING.match(callee), (
                    f"{path.name}:{node.lineno} calls {callee} at import")


BACKEND_MODULES = sorted(p for p in (PACKAGE / "backends").glob("*.py")
                         if p.name not in ("__init__.py", "base.py"))


@pytest.mark.parametrize("path", BACKEND_MODULES, ids=lambda p: _module_name(p))
def test_backends_know_nothing_of_each_other(path):
    """A backend lowers one form of node, its NodeProgram: it never asks
    which kind of node it has (`.generic`) nor reads where the node came
    from (the op table, the captured programs); it imports no other backend
    (what they share is in backends/base.py) and no module's private
    names.  Which backend runs a graph is the graph cache's policy."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            assert node.attr != "generic", f"{path.name}:{node.lineno} branches on .generic"
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fastlazy"):
            for alias in node.names:
                private = alias.name.startswith("_") and not (
                    PACKAGE.parent / node.module.replace(".", "/") / alias.name).with_suffix(
                        ".pyx").exists()
                assert not private, f"{path.name}:{node.lineno} imports {node.module}.{alias.name}"
    imported = _imports(path)
    others = {_module_name(p) for p in BACKEND_MODULES} - {_module_name(path)}
    assert not imported & others, f"{path.name} imports {sorted(imported & others)}"
    sources = {"fastlazy.optable", "fastlazy.generic", "fastlazy.graph"}
    assert not imported & sources, f"{path.name} imports {sorted(imported & sources)}"
