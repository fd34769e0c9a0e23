"""A griffe extension for the library reference (mkdocstrings): the docstrings are written to
read well in ``help()``, and two of their habits would print wrong in Markdown. Cross-references
in reStructuredText roles (:class:`Plan`, :func:`reshard`) become inline code; a doctest example
(``>>>`` lines and their output), which Markdown takes for nested block quotes, becomes a
highlighted code block."""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj):`~?([^`]+)`")
# A doctest: a ">>> " line and every line up to the next blank one, at one indentation.
DOCTEST = re.compile(r"^([ \t]*)>>> .*(?:\n(?!\s*$).*)*", re.M)


def _fenced(match: re.Match) -> str:
    indent = match.group(1)
    return f"{indent}```pycon\n{match.group(0)}\n{indent}```"


class DocstringMarkdown(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = DOCTEST.sub(_fenced, ROLE.sub(r"`\1`", obj.docstring.value))
