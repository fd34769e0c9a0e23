"""The docs site built once per session with mkdocs (the ``docs`` extra), strict, into a
temporary folder: what the site tests read."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.helpers import ROOT


@pytest.fixture(scope="session")
def site(tmp_path_factory) -> Path:
    if importlib.util.find_spec("mkdocs") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("mkdocs is missing: .ci/run installs the docs extra before the tests")
        pytest.skip("the docs extra is not installed: pip install -e '.[docs]'")
    out = tmp_path_factory.mktemp("site")
    p = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    return out
