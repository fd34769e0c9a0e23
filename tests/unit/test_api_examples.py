"""The public API's documentation: each function says Args, Returns, Raises, and its example runs.

Every example is executed as a doctest on the tiny checkpoint (``MODEL``), writing into a fresh
directory (``OUT``), so a docstring that drifts from the code fails here.
"""

import doctest

import pytest

import qwen35_reshard
from qwen35_reshard.plan.planner import stage_tensors
from qwen35_reshard.servers.deployment import rank_stage
from qwen35_reshard.servers.unsplit import server_stage
from qwen35_reshard.verify import verify

PUBLIC = {
    "read_checkpoint": qwen35_reshard.read_checkpoint,
    "make_plan": qwen35_reshard.make_plan,
    "write_plan": qwen35_reshard.write_plan,
    "reshard": qwen35_reshard.reshard,
    "verify": verify,
    "repair": qwen35_reshard.repair,
    "open_stage": qwen35_reshard.open_stage,
    "choose": qwen35_reshard.choose,
    "server_stage": server_stage,
    "rank_stage": rank_stage,
    "stage_tensors": stage_tensors,
}


@pytest.mark.parametrize("name", PUBLIC)
def test_docstring_sections(name):
    doc = PUBLIC[name].__doc__ or ""
    for section in ("Args:", "Returns:", "Raises:", "Example:"):
        assert f"\n    {section}\n" in doc, f"{name} has no {section} section"


@pytest.mark.parametrize("name", PUBLIC)
def test_example_runs(name, make_checkpoint, tmp_path):
    model = make_checkpoint()
    globs = {"MODEL": str(model), "OUT": str(tmp_path / "out")}
    tests = doctest.DocTestFinder(recurse=False).find(PUBLIC[name], name, globs=globs)
    assert tests and tests[0].examples, f"{name} has no example"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in tests:
        runner.run(test)
    assert runner.summarize(verbose=False).failed == 0
