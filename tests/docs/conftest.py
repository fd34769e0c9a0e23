"""The docs site built once per session with mkdocs (the ``docs`` extra), strict, into a
temporary folder: what the site tests read. Every test that needs the ``docs`` extra (the site,
or Python-Markdown itself) asks for ``docs_extra``: without it they skip together, but under CI
(which installs it) they fail."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.helpers import ROOT

# What the docs extra brings that the tests use: mkdocs builds the site, with Python-Markdown.
DOCS_MODULES = ("mkdocs", "markdown")


@pytest.fixture(scope="session")
def docs_extra() -> None:
    missing = [m for m in DOCS_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{', '.join(missing)} missing: .ci/run installs the docs extra before the tests")
        pytest.skip("the docs extra is not installed: pip install -e '.[docs]'")


@pytest.fixture(scope="session")
def site(docs_extra, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    p = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    return out
