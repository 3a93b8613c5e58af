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
