"""The documentation speaks to users: the design document lives in docs/, no planning words (issue numbers,
"done-when" targets) in the README, the docs or the reports the benchmarks generate, the README's first
commands stay as they are, and every `nvfp4-serve` command line in the README parses."""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PLANNING = re.compile(
    r"\bissue\s*#?\d+|\bthe issue\b|\bissue's|done[- ]when|\bthe seed's\b|shared/DESIGN", re.IGNORECASE)
FIRST_COMMANDS = ('pip install torch==2.13.0 && pip install -e . && nvfp4-serve up',
                  'pip install torch==2.13.0 && pip install -e ".[test]" && python3 -m pytest -q -n 2 --dist loadfile tests')


def user_docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "benchmarks").glob("*.md"))]


def test_the_design_document_is_the_projects_own_and_is_referenced():
    design = (ROOT / "docs" / "design.md").read_text()
    assert "## The NVFP4 KV format" in design and "## Paged pool" in design
    assert "`docs/design.md`" in (ROOT / "README.md").read_text()
    assert "`design.md`" in (ROOT / "docs" / "structure.md").read_text()


@pytest.mark.parametrize("path", user_docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_speak_to_users_not_of_planning(path):
    hits = [f"{i}: {line.strip()}" for i, line in enumerate(path.read_text().splitlines(), 1) if PLANNING.search(line)]
    assert not hits, hits


def test_regenerated_reports_speak_to_users_and_match_the_committed_ones(tmp_path):
    from benchmarks.agentic.report import main as agentic_report
    from benchmarks.serving.experiments_report import main as experiments_report

    bench = ROOT / "docs" / "benchmarks"
    shutil.copy(bench / "serving.json", tmp_path)
    shutil.copy(bench / "agentic.json", tmp_path)
    assert experiments_report([str(tmp_path / "serving.json"), "--report", str(tmp_path / "README.md")]) == 0
    assert agentic_report([str(tmp_path / "agentic.json"), "--out", str(tmp_path / "agentic.md")]) == 0
    for name in ("README.md", "agentic.md"):
        text = (tmp_path / name).read_text()
        assert not PLANNING.search(text), PLANNING.search(text)
        committed = (bench / name).read_text()
        headings = [line for line in text.splitlines() if line.startswith("#")]
        assert headings and all(h in committed for h in headings), name
    assert "## Design targets" in (tmp_path / "README.md").read_text()


def test_the_first_commands_are_unchanged():
    readme = (ROOT / "README.md").read_text()
    first = readme.split("## First commands", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", first, re.DOTALL)
    assert [b.strip() for b in blocks[:2]] == list(FIRST_COMMANDS)


def _readme_command_lines() -> list[list[str]]:
    readme = (ROOT / "README.md").read_text()
    out = []
    for block in re.findall(r"```bash\n(.*?)```", readme, re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            if line.startswith("nvfp4-serve ") and "&&" not in line:
                out.append(shlex.split(line)[1:])
    return out


def test_every_nvfp4_serve_command_in_the_readme_parses():
    from decode_svc.config import build_arg_parser as decode_parser
    from nvfp4_serve.launcher import build_arg_parser as up_parser
    from prefill_svc.config import build_arg_parser as prefill_parser
    from router.config import build_arg_parser as router_parser

    parsers = {"up": up_parser, "prefill": prefill_parser, "decode": decode_parser, "router": router_parser}
    commands = _readme_command_lines()
    assert {argv[0] for argv in commands} >= {"up", "prefill", "decode", "router"}
    for argv in commands:
        if argv[0] in parsers:
            parsers[argv[0]]().parse_args(argv[1:])  # SystemExit on an unknown flag or a bad value
