"""Short command-line errors: jsonargparse's nested reports cut down to the key, the value and what is allowed.

jsonargparse reports a bad value of a ``class_path``/``init_args`` entry as a tree: ``Parser key "data":``,
then ``Does not validate against any of the Union subtypes`` with one error per subtype (``NoneType``
and the base class included), then a dump of the whole given ``Namespace(...)``. The one line that
matters (our own constructor's ``\\`num_workers\\` must be an integer >= 0, got -2``) sits inside.
:func:`condense` walks that tree and keeps the key path, the class it is about and that line::

    >>> condense('Parser key "trainer.max_epochs":\\n  Does not validate against any of the Union subtypes\\n'
    ...          "  Subtypes: [<class 'int'>, <class 'NoneType'>]\\n  Errors:\\n    - Expected a <class 'int'>\\n"
    ...          "    - Expected a <class 'NoneType'>\\n  Given value type: <class 'str'>\\n  Given value: x")
    'trainer.max_epochs: expected int or null, got x'

Pure text in, text out: any message it does not recognise comes back as one line, Namespace dumps cut.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass, replace
from typing import Optional

UNION = "Does not validate against any of the Union subtypes"
_PARSER_KEY = re.compile(r'^Parser key "([^"]+)":\s*(.*)$')
_CLASS_PROBLEM = re.compile(r"^Problem with given class_path '([^']+)':\s*(.*)$")
_NESTED_ARG = re.compile(r"^NestedArg\(key='([^']*)', val=(.*)\)$")
_CLASS_PATH = re.compile(r"class_path='([^']+)'")
_EXPECTED = re.compile(r"^Expected a (.+)$")
_EXPECTED_CLASS = re.compile(r"Expected an? <class '(?:[\w.]+\.)?(\w+)'>")
_CLASS_REPR = re.compile(r"<class '(?:[\w.]+\.)?(\w+)'>")
# subtypes a value was also tried against only because the annotation allows them (None, the base class)
_NOISE = (re.compile(r"^Expected a <class 'NoneType'>$"), re.compile(r"^Not a valid subclass of "))


@dataclass(frozen=True)
class Problem:
    """One bad value: where it is (``keys``, outermost first), the class it configures, what is wrong."""

    keys: tuple[str, ...] = ()
    class_path: Optional[str] = None
    text: str = ""
    value: Optional[str] = None

    def sentence(self) -> str:
        """``trainer.callbacks.init_args.band (lightning_dltune.DataLoaderTuner): <text>, got <value>``."""
        where = ".".join(self.keys)
        if self.class_path:
            where = f"{where} ({self.class_path})" if where else self.class_path
        text = self.text
        said = self.value is None or "got" in text.lower() or "not accepted" in text
        if not said:
            text = f"{text}, got {self.value}"
        return f"{where}: {text}" if where else text


def condense(message: str) -> str:
    """The one-paragraph form of a jsonargparse error ``message`` (see the module's docstring)."""
    return problem_of(message).sentence()


def problem_of(message: str) -> Problem:
    """The innermost :class:`Problem` a jsonargparse error ``message`` describes."""
    return _walk(textwrap.dedent(message).strip(), Problem())


def _walk(block: str, found: Problem) -> Problem:
    """Descend one level of the report in ``block``, ``found`` holding what the outer levels said."""
    head, _, rest = block.partition("\n")
    head, rest = head.strip(), textwrap.dedent(rest).strip()
    key = _PARSER_KEY.match(head)
    if key:
        inner = found.keys + (("init_args",) if found.class_path else ()) + (key[1],)
        return _walk(_joined(key[2], rest), replace(found, keys=inner))
    problem = _CLASS_PROBLEM.match(head)
    if problem:
        return _walk(_joined(problem[2], rest), replace(found, class_path=problem[1]))
    if head.startswith(UNION):
        return _union(rest, found)
    return replace(found, text=_one_line(block))


def _joined(head_tail: str, rest: str) -> str:
    return f"{head_tail}\n{rest}".strip() if head_tail else rest


def _union(rest: str, found: Problem) -> Problem:
    """The error of the subtype that was meant, out of a union's list, with the given value."""
    items, given = _union_parts(rest)
    found = _with_given(found, given)
    expected = [m[1] for m in (_EXPECTED.match(i) for i in items) if m]
    if items and len(expected) == len(items):  # plain types, e.g. int | None: say them all
        names = [_CLASS_REPR.sub(r"\1", e).replace("NoneType", "null") for e in expected]
        return replace(found, text="expected " + " or ".join(names))
    meant = [i for i in items if not any(n.match(i) for n in _NOISE)] or items
    if not meant:
        return replace(found, text=UNION)
    inner = _walk(meant[0], replace(found, value=None))
    return inner if inner.value is not None else replace(inner, value=found.value)


def _union_parts(rest: str) -> tuple[list[str], Optional[str]]:
    """(each subtype's error, the ``Given value`` line) of a union report's body."""
    items: list[list[str]] = []
    given = None
    in_errors = False
    for line in rest.splitlines():
        if line.startswith("Errors:"):
            in_errors = True
        elif line.startswith("Given value:"):
            given = line[len("Given value:") :].strip()
        elif in_errors and line.startswith("  - "):
            items.append([line[4:]])
        elif in_errors and line.startswith("    ") and items:
            items[-1].append(line[4:])
        elif not line.startswith(" "):
            in_errors = False
    return ["\n".join(item) for item in items], given


def _with_given(found: Problem, given: Optional[str]) -> Problem:
    """``found`` with the value (and class or key) that the ``Given value`` line names, when it is not a dump."""
    if given is None:
        return found
    nested = _NESTED_ARG.match(given)
    if nested:  # --data.init_args.num_worker 2: the command line named one init arg
        return replace(found, value=nested[2].strip("'") if nested[1] != "class_path" else None)
    if "Namespace(" in given:
        paths = _CLASS_PATH.findall(given)
        if len(set(paths)) == 1 and not found.class_path:  # several callbacks: no telling which one
            return replace(found, class_path=paths[0])
        return found
    return replace(found, value=given)


def _one_line(block: str) -> str:
    """``block`` as one line, class reprs shortened, a ``Namespace(...)`` dump cut."""
    text = " ".join(line.strip() for line in block.splitlines() if line.strip())
    text = _CLASS_REPR.sub(r"\1", _EXPECTED_CLASS.sub(r"expected \1", text))
    cut = text.find("Namespace(")
    return text if cut < 0 else text[:cut].rstrip(" :,") + " (...)"
