"""What every nvfp4-serve command's ``--help`` and ``--version`` show.

``HelpFormatter`` appends each flag's default to its help ("(default: 16)") unless the text already says
what the default is (a flag whose default is None or False says it in words: "default: the embedded model");
``add_version`` adds ``--version``. Every parser of the CLI uses both (``tests/test_cli_help.py`` checks).
"""

from __future__ import annotations

import argparse
from importlib import metadata

DIST_NAME = "nvfp4-serve"


def version() -> str:
    """The installed distribution's version ("unknown" when running from a tree that was never installed)."""
    try:
        return metadata.version(DIST_NAME)
    except metadata.PackageNotFoundError:
        return "unknown"


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions kept as written; "(default: X)" after every flag whose help does not already name it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        unset = default is None or default is False or default == "" or default == argparse.SUPPRESS
        if (unset or not action.option_strings or "default" in text.lower()
                or isinstance(action, (argparse._HelpAction, argparse._VersionAction))):
            return text
        return f"{text} (default: %(default)s)"


def add_version(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--version", action="version", version=f"{DIST_NAME} {version()}")
    return parser
