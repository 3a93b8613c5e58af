"""The README's supported-ops table is the op table's."""
import pathlib

from fastlazy import optable

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_readme_ops_table_is_generated_from_the_op_table():
    text = README.read_text()
    table = text.split("<!-- ops -->\n", 1)[1].split("\n<!-- /ops -->", 1)[0]
    assert table == optable.markdown(), (
        "README's ops table is stale: regenerate it with "
        "python -c 'import fastlazy.optable as t; print(t.markdown())'")


def _stub_names(path):
    import ast
    tree = ast.parse(path.read_text())
    names = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            members = {m.name for m in node.body if isinstance(m, ast.FunctionDef)}
            members |= {m.target.id for m in node.body if isinstance(m, ast.AnnAssign)}
            names[node.name] = members
    return names


def _public(module):
    return {n for n in dir(module) if not n.startswith("_")
            and getattr(getattr(module, n), "__module__", None) == module.__name__}


def test_core_stubs_declare_every_public_name_of_the_core():
    """fastlazy/_core.pyi and _steps.pyi are current: every public function
    and class of the compiled modules, and every method LazyTensor defines
    in the core."""
    import fastlazy._core as core
    import fastlazy._steps as steps
    from fastlazy._core import LazyTensor
    for module in (core, steps):
        stub = _stub_names(pathlib.Path(module.__file__).parent
                           / (module.__name__.rsplit(".", 1)[1] + ".pyi"))
        public = _public(module)
        assert public - set(stub) == set(), f"missing from {module.__name__}'s stub"
        assert set(stub) - public - {"__getattr__"} == set(), f"{module.__name__}: stale stub"
    stub = _stub_names(pathlib.Path(core.__file__).with_name("_core.pyi"))
    own = {n for n, v in vars(LazyTensor).items() if not n.startswith("_")
           and type(v).__name__ in ("cython_function_or_method", "method_descriptor",
                                    "getset_descriptor")}
    assert own - stub["LazyTensor"] == set(), "LazyTensor methods missing from _core.pyi"


def test_help_of_the_package_is_its_public_api_on_one_page():
    """help(fastlazy): the facade's functions with their docstrings, not
    LazyTensor's hundreds of methods; enable() names every backend."""
    import pydoc

    import fastlazy
    from fastlazy import graph_cache
    text = pydoc.render_doc(fastlazy, renderer=pydoc.plaintext)
    assert len(text.splitlines()) < 160          # (a line per module among them)
    assert "annotations" not in fastlazy.__dict__ and "annotations" not in text
    assert "SUBMODULES" not in text             # no private module aliases
    for name in fastlazy.__all__:
        obj = getattr(fastlazy, name)
        assert obj.__doc__ and obj.__doc__.strip(), f"fastlazy.{name} has no docstring"
    for name in graph_cache.backend_names():
        assert f'"{name}"' in fastlazy.enable.__doc__, name
    assert fastlazy.BACKENDS == graph_cache.backend_names()
