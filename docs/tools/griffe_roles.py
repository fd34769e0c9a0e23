"""A griffe extension for the library reference (mkdocstrings): the docstrings cross-reference
in reStructuredText roles (:class:`Plan`, :func:`reshard`), which Markdown would print as
written; each becomes inline code."""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj):`~?([^`]+)`")


class Roles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(r"`\1`", obj.docstring.value)
