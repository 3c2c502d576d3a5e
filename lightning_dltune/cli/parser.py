"""The ``dltune`` argument parser: no abbreviated options, and errors as one short paragraph.

LightningCLI builds every parser (the main one and one per subcommand) from its ``parser_class``, so
this class reaches them all. It changes what argparse and jsonargparse do on a mistake:

- ``--trainer.max_epoch 1`` is refused instead of being taken as ``--trainer.max_epochs`` (argparse
  expands any unambiguous prefix), and the error names the option meant:
  ``dltune: error: unrecognized option --trainer.max_epoch; did you mean --trainer.max_epochs?``
- a bad value is said in one paragraph (:func:`lightning_dltune.cli.errors.condense`): no usage dump,
  no union-subtype report, no ``Namespace(...)``; the exit status stays 2.

Parsers that raise instead of exiting (``exit_on_error=False``, jsonargparse's own nested ones) and
``JSONARGPARSE_DEBUG`` keep jsonargparse's behaviour.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import re
import sys
from typing import Any, NoReturn, Optional

from lightning.pytorch.cli import LightningArgumentParser

from lightning_dltune.cli.errors import condense

_UNRECOGNIZED = re.compile(r"^unrecognized arguments: (.*)$", re.IGNORECASE | re.DOTALL)
_NOT_ACCEPTED = re.compile(r"Option '([^']+)' is not accepted")
_CLASS_OF = re.compile(r"^[\w.]+ \(([\w.]+)\): ")


class DLTuneArgumentParser(LightningArgumentParser):
    """LightningArgumentParser that refuses abbreviations and says an error in one paragraph."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.subcommands_action: Any = None

    def add_subcommands(self, *args: Any, **kwargs: Any) -> Any:
        """jsonargparse's ``add_subcommands``, the action kept so that ``dltune`` can list ``sweep`` in it."""
        self.subcommands_action = super().add_subcommands(*args, **kwargs)
        return self.subcommands_action

    def error(self, message: str, ex: Optional[Exception] = None) -> NoReturn:
        """Print ``dltune: error: <one paragraph>`` and where the options are, then exit with 2."""
        if not self.exit_on_error or os.environ.get("JSONARGPARSE_DEBUG", "").lower() not in ("", "false"):
            super().error(message, ex)
        parser = self._failed_parser(ex)
        prog = parser.prog.replace(" [options]", "")
        sys.stderr.write(f"{prog.split()[0]}: error: {short_message(message, parser)}\n")
        sys.stderr.write(f"Run '{prog} --help' for the options.\n")
        self.exit(2)

    def _failed_parser(self, ex: Optional[Exception]) -> Any:
        """The (sub)command parser the error is about: the one named in ``ex``, else the subcommand given."""
        parser = getattr(ex, "subcommand_parser", None)
        if parser is not None:
            return parser
        choices = getattr(self.subcommands_action, "choices", None) or {}
        given = [word for word in getattr(self, "args", None) or [] if word in choices]
        return choices[given[0]] if given else self


def short_message(message: str, parser: Any) -> str:
    """``message`` in one paragraph, an unknown option or init arg followed by the closest known one."""
    unknown = _UNRECOGNIZED.match(message.strip())
    if unknown:
        return _unrecognized(unknown[1].split(), parser)
    text = condense(message)
    rejected, owner = _NOT_ACCEPTED.search(text), _CLASS_OF.match(text)
    if rejected and owner:
        meant = closest(rejected[1], _init_arg_names(owner[1]))
        if meant:
            text += f"; did you mean '{meant}'?"
    return text


def _unrecognized(words: list[str], parser: Any) -> str:
    options = [w.split("=", 1)[0] for w in words if w.startswith("-")]
    if not options:
        return f"unrecognized arguments: {' '.join(words)}"
    text = f"unrecognized option {options[0]}"
    meant = closest(options[0], option_names(parser))
    if meant:
        text += f"; did you mean {meant}?"
    if len(options) > 1:
        text += f" (also unrecognized: {', '.join(options[1:])})"
    return text


def option_names(parser: Any) -> list[str]:
    """Every option string of ``parser``, nested ones (``--trainer.max_epochs``) included.

    A hyphenated alias (``--step-ms``) is left out where its underscore twin exists: that is the one to suggest.
    """
    names = [name for action in parser._actions for name in action.option_strings]
    known = set(names)
    return [n for n in names if not (n.startswith("--") and "-" in n[2:] and "--" + n[2:].replace("-", "_") in known)]


def closest(word: str, candidates: list[str]) -> Optional[str]:
    """The candidate closest to ``word`` (difflib's ratio at least 0.75), or ``None``."""
    found = difflib.get_close_matches(word, candidates, n=1, cutoff=0.75)
    return found[0] if found else None


def _init_arg_names(class_path: str) -> list[str]:
    """The constructor parameters of the class at ``class_path`` and its bases (a ``**kwargs`` passes them on).

    None when the class does not import.
    """
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return []
    names: list[str] = []
    for klass in getattr(cls, "__mro__", ())[:-1]:  # object's own parameters are no init args
        try:
            parameters = inspect.signature(klass.__init__).parameters.values()
        except (TypeError, ValueError):
            continue
        names += [p.name for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name != "self"]
    return names
