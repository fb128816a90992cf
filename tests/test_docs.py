"""The README and docs/ keep their promises: CPU commands parse, internal links resolve.

A fenced block tagged ```` ```bash cpu ```` (docs/architecture.md, "Documentation conventions") holds commands
a reader can run on a CPU machine. Each one is checked here without running it: its script's own argparse parser
must accept every flag and value (the parser runs, then the script is stopped before it does anything), `hfmeg`
commands likewise through `hfmeg.commands.main.main` (the console script), and `make TARGET` must name a target (`make -n`). Every relative
link and `#anchor` in README.md and docs/*.md must point at a file and heading that exist.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```", re.S | re.M)
LAUNCHERS = {"torchrun", "accelerate"}

# Runs in one subprocess: each command's script with argparse stopped right after a successful parse.
_PARSE_ONLY = r"""
import argparse, json, os, runpy, sys

class Parsed(BaseException):
    pass

original = argparse.ArgumentParser.parse_args
def parse_then_stop(self, args=None, namespace=None):
    original(self, args, namespace)  # argparse exits 2 on an unknown flag or a bad value
    raise Parsed

argparse.ArgumentParser.parse_args = parse_then_stop
failures = []
for kind, target, argv in json.loads(sys.argv[1]):
    sys.argv = [target, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(target)))  # as `python SCRIPT` does: tools import their siblings
    try:
        if kind == "hfmeg":
            from hfmeg.commands.main import main
            main(argv)
        else:
            runpy.run_path(target, run_name="__main__")
        failures.append(f"{target} {' '.join(argv)}: finished without parsing arguments")
    except Parsed:
        pass
    except SystemExit as e:
        if e.code not in (0, None):  # 0: --help
            failures.append(f"{target} {' '.join(argv)}: exit {e.code}")
    finally:
        sys.path.pop(0)
print(json.dumps(failures))
"""


def _code_blocks(text: str) -> list[tuple[str, str]]:
    return [(m.group(1).strip(), m.group(2)) for m in FENCE.finditer(text)]


def _commands(block: str) -> list[list[str]]:
    """Shell lines of a block: continuations joined, comments dropped, split at `&&` and `;`."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        cmd: list[str] = []
        for w in words + [";"]:
            if w in (";", "&&"):
                if cmd:
                    out.append(cmd)
                cmd = []
            else:
                cmd.append(w)
    return out


def cpu_commands() -> list[tuple[str, list[str]]]:
    found = []
    for page in PAGES:
        for info, body in _code_blocks(page.read_text()):
            if info.split()[1:2] == ["cpu"]:
                found += [(page.name, cmd) for cmd in _commands(body)]
    return found


def _as_parse_job(cmd: list[str]) -> tuple[str, str, list[str]] | None:
    """(kind, script or program, argv) for the parse-only runner; None for `make`."""
    if cmd[0] == "make":
        return None
    if cmd[0] == "hfmeg":
        return ("hfmeg", "hfmeg", cmd[1:])
    if cmd[0] == "python" or cmd[0] in LAUNCHERS:
        script = next((i for i, w in enumerate(cmd) if w.endswith(".py")), None)
        assert script is not None, f"no script in {' '.join(cmd)}"
        return ("script", cmd[script], cmd[script + 1:])
    raise AssertionError(f"a `bash cpu` block holds a command this test cannot check: {' '.join(cmd)}")


def test_there_are_cpu_commands_in_the_readme():
    readme = [cmd for page, cmd in cpu_commands() if page == "README.md"]
    assert any(c[:2] == ["make", "demo"] for c in readme) and any("recipes/sft_llama13b.py" in c for c in readme)


def test_every_cpu_command_parses():
    commands = cpu_commands()
    jobs = [job for _, cmd in commands if (job := _as_parse_job(cmd))]
    for kind, target, _ in jobs:
        assert kind == "hfmeg" or (ROOT / target).is_file(), f"{target} does not exist"
    proc = subprocess.run([sys.executable, "-c", _PARSE_ONLY, json.dumps(jobs)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    failures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not failures, "\n".join(failures)
    for _, cmd in commands:
        if cmd[0] == "make":
            targets = [w for w in cmd[1:] if "=" not in w and not w.startswith("-")]
            # -o: treat the venv stamp as up to date, so make -n only checks that the target exists
            r = subprocess.run(["make", "-n", "-o", ".venv/.hfmeg-installed", *targets], cwd=ROOT,
                               capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, f"make {' '.join(targets)}: {r.stderr}"


def test_the_parse_check_catches_a_wrong_flag():
    """The runner must fail on what a reader would hit: an unknown flag, a value outside its choices; and pass a good one."""
    jobs = [("script", "tools/convert_hf_to_mp.py", ["--hf", "x", "--out", "y", "--tp", "2", "--pp", "1", "--typo"]),
            ("script", "tools/convert_hf_to_mp.py", ["--hf", "x", "--out", "y", "--tp", "2", "--pp", "1", "--dtype", "f8"]),
            ("hfmeg", "hfmeg", ["plan", "--no-such-flag"]),
            ("script", "tools/convert_hf_to_mp.py", ["--hf", "x", "--out", "y", "--tp", "2", "--pp", "1"])]
    proc = subprocess.run([sys.executable, "-c", _PARSE_ONLY, json.dumps(jobs)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    failures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [f.split(":")[0].split()[-1] for f in failures] == ["--typo", "f8", "--no-such-flag"], failures


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip().lower())
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return kept.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    seen: dict[str, int] = {}
    anchors = set()
    for m in re.finditer(r"^#{1,6} (.+)$", text, re.M):
        slug = _slug(m.group(1))
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def _links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code is not a link
    return re.findall(r"\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_internal_links_and_anchors_resolve(page):
    broken = []
    for link in _links(page):
        if re.match(r"[a-z]+:", link):  # http(s), mailto: not checked offline
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{link}: no file {target.relative_to(ROOT) if ROOT in target.parents else target}")
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
            broken.append(f"{link}: no heading with anchor #{anchor} in {target.name}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


def test_slugs_follow_github():
    assert _slug("In a training run: `--layout auto`") == "in-a-training-run---layout-auto"
    assert _slug("Shared-unlock warm start (pretraining from scratch)") == \
        "shared-unlock-warm-start-pretraining-from-scratch"
    assert _slug("GPU checklist, 2026-11-23") == "gpu-checklist-2026-11-23"
