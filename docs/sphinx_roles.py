"""Griffe extension for the docs site: Sphinx roles in docstrings (:class:`~a.B`) rendered as code (``B``).

The docstrings are Google style with Sphinx cross-reference roles, which Markdown would show as raw text.
"""

from __future__ import annotations

import re

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|mod|data|exc|obj):`(~?)([^`]+)`")


def _code(match: re.Match[str]) -> str:
    short, target = match.group(1), match.group(2)
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


class SphinxRoles(griffe.Extension):
    """Rewrites each role in a docstring to an inline code span, the last dotted part where ``~`` asks for it."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: object) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(_code, obj.docstring.value)
