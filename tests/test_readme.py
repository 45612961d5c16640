"""Every python block of the README runs as written."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
# Runnable blocks are those that import parsum (the one-line teaser at the top is not); a block
# that joins a process group needs torchrun, and runs as examples/distributed_ensemble.py in
# test_examples instead.
BLOCKS = [
    b
    for b in re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    if "import parsum" in b and "init_process_group" not in b
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index, capsys):
    code = BLOCKS[index]
    exec(compile(code, f"README.md block {index}", "exec"), {})
    printed = capsys.readouterr().out
    if "print(" in code:
        assert printed
