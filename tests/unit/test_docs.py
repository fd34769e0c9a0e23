"""The docs say what the tool does: the command reference and the API page are the commands'
own --help and the docstrings, the README stays a front page whose links lead somewhere."""

from __future__ import annotations

import re
import sys

import pytest

from support.helpers import ROOT

sys.path.insert(0, str(ROOT / "docs" / "tools"))

import gen_cli  # noqa: E402


def test_command_reference_is_current():
    assert gen_cli.PAGE.read_text() == gen_cli.page(), "run: python docs/tools/gen_cli.py"


def test_library_reference_renders_every_public_name():
    """api-reference.md has mkdocstrings render each name of ``qwen35_reshard.__all__``."""
    import qwen35_reshard

    text = (ROOT / "docs" / "api-reference.md").read_text()
    rendered = set(re.findall(r"^::: qwen35_reshard\.(\w+)$", text, re.M))
    assert set(qwen35_reshard.__all__) - {"__version__"} <= rendered


def test_readme_is_a_front_page_with_working_links():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert targets
    for target in targets:
        if not target.startswith("http"):
            assert (ROOT / target).exists(), target
    # Exactly two quick-start commands.
    quick = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert quick.count("```\n") == 4


def test_every_page_is_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in (ROOT / "docs").rglob("*.md"):
        assert f": {page.relative_to(ROOT / 'docs')}" in nav, page.name


def test_vllm_note_of_the_quick_start(tiny, tmp_path):
    """The README says the example cannot be split for vLLM at --pp 4, and gives --pp 2: both true."""
    from qwen35_reshard import ReshardError, reshard

    text = (ROOT / "README.md").read_text()
    assert "--pp 2 --runtime vllm $D/model" in text and "`--pp 4 --runtime vllm`" in text
    model = tiny.build_checkpoint(tmp_path / "model")
    with pytest.raises(ReshardError, match="full-attention"):
        reshard(model, None, pp=4, runtime="vllm", dry_run=True)
    assert reshard(model, tmp_path / "vllm", pp=2, runtime="vllm").written.built == [0, 1]


def _documented(section: str) -> set[str]:
    """The fields docs/json.md's table under ``section`` names (first column, backticked)."""
    text = (ROOT / "docs" / "json.md").read_text().split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in text.splitlines() if line.startswith("| `")]
    return {name for row in rows for name in re.findall(r"`(\w+)`", row)}


def test_json_page_names_the_fields_the_documents_have(tiny, tmp_path):
    """Every field the --json documents have is on docs/json.md, and every field there is in some
    document (``fetch``: a Hub source only, run by tests/e2e/test_hub.py; ``unchecked_quantization``:
    an unknown quantization method only, run by tests/unit/model/test_quant.py; ``server_flags``:
    ``--ep`` only, run by tests/e2e/test_expert_parallel.py)."""
    import json
    import subprocess

    model = tiny.build_checkpoint(tmp_path / "model")

    def doc(*args):
        p = subprocess.run([sys.executable, "-m", "qwen35_reshard", *map(str, args), "--json"],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
        return json.loads(p.stdout)

    split = [
        doc("--pp", 2, model, tmp_path / "out"),
        doc("plan", "--pp", 2, "--partition", "balanced", model),
        doc("plan", "--pp", 2, "--nnodes", 2, "--node-rank", 1, model),
        doc("plan", "--pp", 99, model),
    ]
    seen = set().union(*split)
    assert split[-1]["status"] == "error" and "node" in split[2] and "balanced" in split[1]
    assert seen <= _documented("`split` and `plan`")
    assert _documented("`split` and `plan`") - seen == {"fetch", "unchecked_quantization", "server_flags"}
    report = doc("verify", tmp_path / "out")
    assert set(report) == _documented("`verify`")


def test_paths_the_docs_name_exist():
    """Every file of this repository the pages name (tests, scripts, examples) is there."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    path = re.compile(r"((?:tests|examples|benchmarks|\.ci)/[\w./-]+\.(?:py|sh))")
    named = {p for page in pages for p in path.findall(page.read_text())}
    assert named
    assert [p for p in sorted(named) if not (ROOT / p).exists()] == []


def _pyproject() -> dict:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _section(page: str, heading: str) -> str:
    text = (ROOT / "docs" / page).read_text()
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def test_server_environment_install_names_every_runtime_dependency():
    """The ``--no-deps`` recipe for a server's environment then installs exactly the package's
    runtime dependencies, as pyproject.toml pins them (msgspec was left out: ``import
    qwen35_reshard.loader`` then failed in the server)."""
    import shlex

    section = _section("install.md", "Into a server's environment")
    commands = [shlex.split(line) for line in re.findall(r"^pip install .*$", section, re.M)]
    assert ["pip", "install", "--no-deps", "./qwen35-reshard"] in commands
    named = {req for words in commands if "--no-deps" not in words for req in words[2:]}
    assert named == {dep.replace(" ", "") for dep in _pyproject()["dependencies"]}


def test_loader_extra_pulls_no_torch_and_the_docs_say_how_to_get_one():
    """An unpinned torch from the index is the multi-GB CUDA build: the ``loader`` extra leaves
    torch out, and install.md installs a chosen build before the extra."""
    extra = _pyproject()["optional-dependencies"]["loader"]
    assert not [req for req in extra if re.match(r"torch\b", req)], extra
    section = _section("install.md", "The loader shim")
    torch_at = section.index("pip install torch --index-url https://download.pytorch.org/")
    assert torch_at < section.index("[loader]'")


def test_readme_sends_server_installs_to_the_install_page():
    """The README gives no install into a server's environment of its own (it contradicted
    install.md's ``--no-deps`` advice): it links there."""
    text = (ROOT / "README.md").read_text()
    assert "docs/install.md#into-a-servers-environment" in text
    for line in re.findall(r"^.*pip install.*$", text, re.M):
        assert "server" not in line, line


def test_stages_figure_shows_the_plan_tables_sizes():
    """docs/img/stages.svg is what docs/tools/gen_figures.py draws from the plan now, and each
    stage's label is the size the plan table prints (the caption says so; it showed the tensor
    bytes alone, verify's old figure)."""
    import gen_figures

    from qwen35_reshard.units import format_bytes

    plan = gen_figures._plan()
    drawn = (ROOT / "docs" / "img" / "stages.svg").read_text()
    assert drawn == gen_figures.stage_chart(plan), "run: python docs/tools/gen_figures.py"
    labels = re.findall(r">([0-9.]+ [KMG]?B)</text>", drawn)
    assert labels == [format_bytes(s.size) for s in plan.stages]
    assert "the plan table&#x27;s size column" in drawn
    assert "the plan table's size column" in (ROOT / "docs" / "index.md").read_text()


def test_commands_in_the_docs_name_a_model_that_can_exist():
    """A model in a command of the docs (their code blocks, the command reference's --help
    examples) is an ``org/name`` Hub id or a path: a bare ``Qwen3.5-35B-A3B`` is neither, and a
    copied command fails on it."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    bare = re.compile(r"(?<![/\w.-])Qwen3\.5-\d")
    command = re.compile(r"qwen35-reshard |vllm serve|sglang\.launch_server|hf download")
    found = []
    for page in pages:
        for line in page.read_text().splitlines():
            if command.search(line) and bare.search(line):
                found.append(f"{page.name}: {line.strip()}")
    assert found == []


def test_user_pages_hold_no_lab_notes():
    """The pages a user reads say what the tool does, not when or where it was worked on: no
    issue numbers of this project, no dates of work, no notes on the machine a number was taken
    on. Those belong to the development pages (docs/development/)."""
    notes = re.compile(
        r"\b[Ii]ssues? \d+|\b20\d\d-\d\d-\d\d\b|\b\d{1,2} (?:Nov|Dec|Jan|Feb)[a-z]* 20\d\d\b"
        r"|\b\d+-core\b|\bthis (?:machine|VM)\b|\bthese machines\b|when this was written"
    )
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    found = [
        f"{page.name}: {m.group(0)}"
        for page in pages
        if page.name != "development.md"
        for m in notes.finditer(page.read_text())
    ]
    assert found == []
