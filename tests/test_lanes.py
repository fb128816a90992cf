"""The lane lists (conftest.LANES) name files and tests that exist: a renamed test does not leave the quick lane
silently, nor a stale name keep a test in it."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import LANES

TESTS = Path(__file__).parent


def test_every_file_and_test_the_lanes_name_exists():
    for lane, files in LANES.items():
        for file, names in files.items():
            assert (TESTS / file).is_file(), (lane, file)
            defined = {n.name for n in ast.walk(ast.parse((TESTS / file).read_text())) if isinstance(n, ast.FunctionDef)}
            assert not (names or set()) - defined, (lane, file, (names or set()) - defined)
