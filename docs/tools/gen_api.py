"""Write docs/api-reference.md from the public API's own docstrings (tests/test_docs.py fails
when they differ). Run: ``python docs/tools/gen_api.py`` after changing a docstring."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import qwen35_reshard
from qwen35_reshard import verify as verify_module

PAGE = Path(__file__).resolve().parents[1] / "api-reference.md"

INTRO = """# Library reference

Generated from the docstrings by `docs/tools/gen_api.py` (a test fails when they differ).
How the pieces fit: [Library](api.md).
"""


def _public() -> list[tuple[str, object]]:
    names = [(f"qwen35_reshard.{n}", getattr(qwen35_reshard, n)) for n in sorted(qwen35_reshard.__all__)]
    names.append(("qwen35_reshard.verify.verify", verify_module.verify))
    names.append(("qwen35_reshard.verify.VerifyReport", verify_module.VerifyReport))
    return names


def _entry(name: str, obj: object) -> str:
    kind = "class" if inspect.isclass(obj) else "function" if callable(obj) else "value"
    try:
        signature = f"{name.rsplit('.', 1)[1]}{inspect.signature(obj)}" if callable(obj) else name
    except (TypeError, ValueError):
        signature = name
    signature = re.sub(r" at 0x[0-9a-f]+>", ">", signature)  # a default's address: not the same twice
    doc = inspect.getdoc(obj) if kind != "value" else None
    body = f"```\n{doc}\n```\n" if doc else "(no docstring)\n"
    return f"## `{name}`\n\n*{kind}*\n\n```python\n{signature}\n```\n\n{body}"


def page() -> str:
    return "\n".join([INTRO, *(_entry(n, o) for n, o in _public())])


if __name__ == "__main__":
    PAGE.write_text(page())
    print(f"wrote {PAGE}")
