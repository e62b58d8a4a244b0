"""What every command line of the package shares: help that shows each flag's default."""
from __future__ import annotations

import argparse


class Help(argparse.HelpFormatter):
    """Each optional flag's help ends with its default, unless the help already names it: a
    switch is "off" unless given, a flag with no default value (or an empty one) "none"."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text or action.default is argparse.SUPPRESS or not action.option_strings
                or action.required):
            return text
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            shown = "on" if action.default else "off"
        elif action.default in (None, ""):
            shown = "none"
        else:
            shown = "%(default)s"
        return f"{text} (default: {shown})" if text else f"(default: {shown})"

