"""Every python block of the README and of the user guide in docs/ runs as written."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Runnable blocks are those that import parsum (the one-line teaser at the top is not); a block
# that joins a process group needs torchrun, and runs as examples/distributed_ensemble.py in
# test_examples instead.
BLOCKS = [
    (page.relative_to(ROOT).as_posix(), k, block)
    for page in PAGES
    for k, block in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S))
    if re.search(r"^(import .*\bparsum\b|from parsum\b)", block, flags=re.M)
    and "init_process_group" not in block
]


def test_the_guide_has_runnable_blocks():
    pages = {page for page, _, _ in BLOCKS}
    assert {
        "README.md",
        "docs/tour.md",
        "docs/gradients.md",
        "docs/sampled-rows.md",
        "docs/identical-models.md",
        "docs/sum-models.md",
    } <= pages


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("page", "index", "code"), BLOCKS, ids=[f"{p}-{k}" for p, k, _ in BLOCKS])
def test_block_runs(page, index, code, capsys):
    exec(compile(code, f"{page} block {index}", "exec"), {})
    printed = capsys.readouterr().out
    if "print(" in code:
        assert printed


def test_docs_image_is_the_benchmarks_plot():
    # docs/ cannot link outside itself, so the plot is copied there; the two must not drift.
    plot = "speedup-2cores.png"
    assert (ROOT / "docs/img" / plot).read_bytes() == (
        ROOT / "benchmarks/results" / plot
    ).read_bytes()
