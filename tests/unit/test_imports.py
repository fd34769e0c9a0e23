"""The package's import graph: layers strictly downward, no cycle; readers load little.

The layer test reads every import of every module with ``ast`` (imports inside functions and
``if TYPE_CHECKING:`` blocks included, relative and absolute), so a type-only import that
goes up counts like any other. ``LAYERS`` is the table: every module of the package is in it,
so a new module needs a decision about where it sits.

The other cases run in a fresh interpreter, so modules other tests imported do not count: a
server imports ``qwen35_reshard.loader`` in every worker; what it pulls in is what it pays
for and what can break it.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from support.helpers import ROOT

PACKAGE = ROOT / "qwen35_reshard"

# (rank, group, modules), bottom first. A module may import a module of a lower rank, or one of
# its own group; never one of a higher rank or of another group at its rank: the writer and the
# readers (verify, the loader) sit side by side, so readers never import the writer, nor it them.
LAYERS = [
    (0, "base", ["_version", "errors", "units", "bulk"]),
    (1, "format", ["format", "format.names", "format.dtypes", "format.jsonio", "format.paths",
                   "format.digest", "format.manifest", "format.identity", "format.holder"]),
    (2, "model", ["model", "model.names", "model.modules", "model.quant", "model.quant.schemes",
                  "model.quant.config", "model.completeness", "model.schema", "model.runtimes",
                  "model.experts", "model.parallelism"]),
    # One remote checkpoint reader (remote: the store protocol, the checkpoint, the fetch, the
    # engine) over stores (hub, s3): a store imports remote, never another store.
    (3, "source", ["source", "source.header", "source.checkpoint", "source.remote", "source.remote.parts",
                   "source.remote.settings", "source.remote.engine", "source.remote.store",
                   "source.remote.checkpoint", "source.remote.fetch", "source.ranged", "source.hub",
                   "source.hub.cache", "source.hub.http", "source.hub.store", "source.s3", "source.s3.store",
                   "source.open"]),
    (4, "plan", ["plan", "plan.layout", "plan.planner", "plan.capacity", "plan.balance", "plan.fetch",
                 "plan.nodes", "plan.experts", "plan.nodedirs"]),
    (5, "transfer", ["transfer", "transfer.reflink", "transfer.segments", "transfer.pages", "transfer.hasher",
                     "transfer.copier"]),
    (6, "stage", ["stage", "stage.findings", "stage.manifest", "stage.nodes", "stage.reader",
                  "stage.digestpool", "stage.nodechecks"]),
    (7, "verify", ["verify", "verify.report", "verify.rundir", "verify.stagedir", "verify.source",
                   "verify.selection", "verify.check"]),
    (7, "loader", ["loader", "loader.checks", "loader.mapping"]),
    (7, "write", ["write", "write.claims", "write.durability", "write.journal", "write.datafile",
                  "write.assemble", "write.assess", "write.sources", "write.provenance", "write.outdir",
                  "write.finish", "write.stageclaims",
                  "write.manifest", "write.options",
                  "write.writer", "write.repair"]),
    (8, "api", ["", "api"]),  # "": the package itself, whose names load on first use
    # The server integrations (issue 37): a rank building its own stage from the unsplit model
    # (issue 33) goes through the library; the load format and the plugin import it only when a
    # rank is handed no split.
    (9, "servers", ["servers", "servers.terms", "servers.unsplit", "servers.stagecache", "servers.deployment",
                    "servers.vllm", "servers.sglang", "servers.inplace", "servers.eprank"]),
    # The CLI sits on top: it may show what the servers keep (the stage cache).
    (10, "cli", ["cli", "cli.progress", "cli.nodeview", "cli.report", "cli.flags", "cli.process", "cli.cache",
                 "cli.app",
                 "__main__"]),
]  # fmt: skip
LAYER = {
    f"qwen35_reshard.{m}".rstrip("."): (rank, group) for rank, group, modules in LAYERS for m in modules
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str, path: Path) -> list[tuple[str, int]]:
    """``(module imported, line)`` for every import of the package's own modules in ``path``."""
    is_package = path.name == "__init__.py"
    here = name.split(".") if is_package else name.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(here[: len(here) - node.level + 1]) if node.level else ""
            mod = ".".join(p for p in (base, node.module or "") if p)
            # "from X import Y" imports the module X.Y when there is one, else names of X.
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in LAYER else mod for a in node.names]
        else:
            continue
        ours = [t for t in targets if t == "qwen35_reshard" or t.startswith("qwen35_reshard.")]
        found += [(t, node.lineno) for t in ours]
    return found


def import_graph() -> dict[str, list[tuple[str, int]]]:
    return {name: imports_of(name, path) for name, path in package_modules().items()}


def test_every_module_has_a_layer():
    modules = set(package_modules())
    assert sorted(modules - set(LAYER)) == [], "add these modules to LAYERS"
    assert sorted(set(LAYER) - modules) == [], "LAYERS names modules that do not exist"


def test_imports_go_strictly_down():
    graph = import_graph()
    upward = []
    for name, edges in graph.items():
        rank, group = LAYER.get(name, (-1, f"{name}, not in LAYERS"))
        for target, line in edges:
            their_rank, their_group = LAYER.get(target, (rank, f"{target}, not in LAYERS"))
            if their_group != group and their_rank >= rank:
                upward.append(f"{name} ({group}) imports {target} ({their_group}) at line {line}")
    upward = sorted(set(upward))
    assert upward == [], "imports that do not go down a layer:\n" + "\n".join(upward)


def test_the_format_is_a_leaf():
    """format imports nothing of the package but errors and the version."""
    allowed = {"qwen35_reshard.errors", "qwen35_reshard._version"}
    outside = sorted(
        f"{name} imports {target} at line {line}"
        for name, edges in import_graph().items()
        if LAYER[name][1] == "format"
        for target, line in edges
        if LAYER[target][1] != "format" and target not in allowed
    )
    assert outside == []


def find_cycle(graph: dict[str, list[tuple[str, int]]]) -> list[str] | None:
    done: set[str] = set()
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        if node in path:
            return path[path.index(node) :] + [node]
        if node in done:
            return None
        path.append(node)
        for target, _ in graph.get(node, []):
            cycle = visit(target)
            if cycle:
                return cycle
        path.pop()
        done.add(node)
        return None

    for node in sorted(graph):
        cycle = visit(node)
        if cycle:
            return cycle
    return None


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_checks_see_type_only_and_function_level_imports(tmp_path):
    """The graph counts an import under TYPE_CHECKING and one inside a function."""
    source = tmp_path / "m.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from ..plan.planner import Plan\n"
        "def f():\n    from ..write import writer\n"
    )
    edges = imports_of("qwen35_reshard.source.m", source)
    assert edges == [("qwen35_reshard.plan.planner", 3), ("qwen35_reshard.write.writer", 5)]
    graph = {"a": [("b", 1)], "b": [("c", 1)], "c": [("a", 1)]}
    assert find_cycle(graph) == ["a", "b", "c", "a"]


WRITERS = ("qwen35_reshard.write", "qwen35_reshard.transfer")
PLANNERS = ("qwen35_reshard.plan",)
FRONT = ("qwen35_reshard.cli", "qwen35_reshard.api")
HEAVY = ("torch", "vllm", "sglang", "transformers")


def loaded_after(statement: str) -> set[str]:
    show = "print('\\n'.join(sys.modules))"
    code = f"import sys; {statement}; {show}"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(run.stdout.split())


def under(modules: set[str], prefixes: tuple[str, ...]) -> list[str]:
    return sorted(m for m in modules if any(m == p or m.startswith(p + ".") for p in prefixes))


@pytest.mark.parametrize(
    "statement",
    [
        "import qwen35_reshard.loader",
        "from qwen35_reshard.servers import vllm",
        "from qwen35_reshard.servers import sglang",
        "import qwen35_reshard.stage.reader",
    ],
)
def test_readers_load_no_writer_planner_or_cli(statement):
    loaded = loaded_after(statement)
    assert "qwen35_reshard.format.names" in loaded  # they do read the format
    assert under(loaded, WRITERS + PLANNERS + FRONT + HEAVY) == []


def test_verify_loads_no_writer():
    loaded = loaded_after("import qwen35_reshard.verify")
    assert under(loaded, ("qwen35_reshard.write",) + FRONT + HEAVY) == []


def test_the_cli_imports_without_torch_or_servers():
    assert under(loaded_after("import qwen35_reshard.cli.app"), HEAVY) == []


def test_package_names_load_on_first_use():
    assert under(loaded_after("import qwen35_reshard"), WRITERS + PLANNERS + FRONT) == []
    loaded = loaded_after("from qwen35_reshard import reshard")
    assert "qwen35_reshard.write.writer" in loaded and "qwen35_reshard.plan.planner" in loaded


def test_unknown_package_attribute_is_an_attribute_error():
    import qwen35_reshard

    with pytest.raises(AttributeError, match="no_such_name"):
        qwen35_reshard.no_such_name  # noqa: B018
