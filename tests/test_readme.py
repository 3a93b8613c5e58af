"""Every Python code block of the README runs as copied, each in a fresh
interpreter (enable() and the backend are process-wide state)."""
import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_the_readme_has_python_blocks():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.splitlines()[0][:40])
def test_readme_block_runs_as_copied(block):
    done = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True,
                          timeout=300, cwd=README.parent)
    assert done.returncode == 0, f"{block}\n--- stderr ---\n{done.stderr[-3000:]}"
