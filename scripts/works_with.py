"""Renders the "Works with" table of docs/works-with.md from tests/test_trainer_features.py and a run of it.

    .venv/bin/python scripts/works_with.py            # runs the matrix, prints the Markdown table
    .venv/bin/python scripts/works_with.py --write    # also replaces the table in docs/works-with.md

Each row of the table is one test of the matrix (parametrised cases are one row): "works" when every
case passed, "known break" when a case is an expected failure (named in the test's reason).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- works-with:begin -->", "<!-- works-with:end -->"


def run_matrix() -> dict[str, list[str]]:
    """Outcome of every case, by test function name: "passed", "xfailed", "failed" or "skipped"."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "matrix.xml"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                f"--junitxml={report}",
                "tests/test_trainer_features.py",
            ],
            cwd=ROOT,
            check=False,
        )
        outcomes: dict[str, list[str]] = {}
        for case in ET.parse(report).iter("testcase"):
            name = re.sub(r"\[.*\]$", "", case.get("name", ""))
            children = {child.tag: child for child in case}
            if "failure" in children or "error" in children:
                outcome = "failed"
            elif "skipped" in children:
                kind = children["skipped"].get("type", "")
                outcome = (
                    "xfailed" if "xfail" in kind or "xfail" in children["skipped"].get("message", "") else "skipped"
                )
            else:
                outcome = "passed"
            outcomes.setdefault(name, []).append(outcome)
    return outcomes


def table(outcomes: dict[str, list[str]]) -> str:
    sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "helpers")]
    from test_trainer_features import ROWS

    lines = ["| Trainer feature | what the test checks | result |", "| --- | --- | --- |"]
    for name, text in ROWS.items():
        feature, checks = text.split("|", 1)
        results = outcomes.get(name, ["not run"])
        if all(r == "passed" for r in results):
            result = "works"
        elif "failed" in results:
            result = "**fails**"
        elif "xfailed" in results:
            result = "known break (see below)"
        else:
            result = "/".join(sorted(set(results)))
        lines.append(f"| {feature} | {checks} | {result} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--write", action="store_true", help="replace the table between the markers of docs/works-with.md"
    )
    args = parser.parse_args()
    rendered = table(run_matrix())
    print(rendered)
    if args.write:
        readme = ROOT / "docs" / "works-with.md"
        text = readme.read_text()
        if BEGIN not in text:
            sys.exit(f"docs/works-with.md has no {BEGIN} ... {END} markers")
        head, rest = text.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
        readme.write_text(f"{head}{BEGIN}\n{rendered}\n{END}{tail}")


if __name__ == "__main__":
    main()
