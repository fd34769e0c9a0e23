"""The package's import graph: readers never load the writer, the planner or the CLI.

A server imports ``qwen35_reshard.loader`` in every worker; what it pulls in is what it pays
for and what can break it. Each case runs in a fresh interpreter, so modules other tests
imported do not count.
"""

import subprocess
import sys

import pytest

WRITERS = ("qwen35_reshard.write", "qwen35_reshard.transfer", "qwen35_reshard.reflink")
PLANNERS = ("qwen35_reshard.plan",)
FRONT = ("qwen35_reshard.cli", "qwen35_reshard.api")


def loaded_after(statement: str) -> set[str]:
    show = "print('\\n'.join(m for m in sys.modules if m.startswith('qwen35_reshard')))"
    code = f"import sys; {statement}; {show}"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(run.stdout.split())


def under(modules: set[str], prefixes: tuple[str, ...]) -> list[str]:
    return sorted(m for m in modules if any(m == p or m.startswith(p + ".") for p in prefixes))


@pytest.mark.parametrize(
    "statement",
    ["import qwen35_reshard.loader", "from qwen35_reshard.loader import vllm", "import qwen35_reshard.stage"],
)
def test_readers_load_no_writer_planner_or_cli(statement):
    loaded = loaded_after(statement)
    assert "qwen35_reshard.ondisk" in loaded  # they do read the format module
    assert under(loaded, WRITERS + PLANNERS + FRONT) == []


def test_verify_loads_no_writer():
    loaded = loaded_after("import qwen35_reshard.verify")
    assert under(loaded, ("qwen35_reshard.write",) + FRONT) == []


def test_package_names_load_on_first_use():
    assert under(loaded_after("import qwen35_reshard"), WRITERS + PLANNERS + FRONT) == []
    loaded = loaded_after("from qwen35_reshard import reshard")
    assert "qwen35_reshard.write.writer" in loaded and "qwen35_reshard.plan.planner" in loaded


def test_unknown_package_attribute_is_an_attribute_error():
    import qwen35_reshard

    with pytest.raises(AttributeError, match="no_such_name"):
        qwen35_reshard.no_such_name  # noqa: B018
