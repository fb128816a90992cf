"""The command line parser every `hfmeg` command and recipe uses: argparse without abbreviations (`--max-step`
is not silently `--max-steps`), and a mistyped flag named, with the closest known one, before argparse would
take its value for a positional argument (`--max-step 5` read as CONFIG `5`)."""

from __future__ import annotations

import argparse
import difflib
import sys


class Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        argv = sys.argv[1:] if args is None else list(args)
        known = [o for o in self._option_string_actions if o.startswith("--")]
        # a subcommand's flags are its own parser's to check
        commands = {c for a in self._actions if isinstance(a, argparse._SubParsersAction) for c in a.choices}
        for token in argv:
            if token == "--" or token in commands:
                break
            flag = token.split("=", 1)[0]
            if flag.startswith("--") and flag not in known:
                close = difflib.get_close_matches(flag, known, n=1)
                self.error(f"unknown flag {flag}" + (f"; did you mean {close[0]}?" if close else ""))
        return super().parse_known_args(argv, namespace)
