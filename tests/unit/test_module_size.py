"""No module of the package is over 500 lines (GUIDE.md: small modules, one job each): every
module's lines are counted, so a module that grows past the limit fails here, named with its
count, until it is split."""

from __future__ import annotations

from support.helpers import ROOT

MAX_LINES = 500


def test_no_module_is_over_the_limit():
    counts = {
        str(path.relative_to(ROOT)): len(path.read_text().splitlines())
        for path in sorted((ROOT / "qwen35_reshard").rglob("*.py"))
    }
    assert len(counts) > 50  # the package was found
    assert {path: n for path, n in counts.items() if n > MAX_LINES} == {}
