"""The flag reference (`docs/flags.md`), generated from the main job's parser so that it cannot drift:

    python -m slime_corr.flag_docs            # rewrites docs/flags.md
    python -m slime_corr.flag_docs --check    # exit 1 when docs/flags.md is stale (tests/test_flag_docs.py runs it)

One table per argument group, in the parser's order: the flag, its default, its choices and its help.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from slime_corr.main import build_parser

DOC = Path(__file__).resolve().parents[1] / "docs" / "flags.md"
HEADER = """# Flags of the main job

Generated from `python -m slime_corr.main`'s parser by `python -m slime_corr.flag_docs` (do not edit by hand;
`tests/test_flag_docs.py` fails when this page is stale). Flags after `--` go to the SGLang servers the job starts (see
docs/engines.md). Every value is checked at parse time with a message that names the flag.
"""


def _cell(text: object) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _default(action: argparse.Action) -> str:
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
        return "off" if action.default is False else "on"
    if action.default is None or action.default == argparse.SUPPRESS:
        return ""
    return f"`{action.default}`"


def render(parser: argparse.ArgumentParser) -> str:
    """The markdown reference of `parser`'s flags."""
    out = [HEADER]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.option_strings and not isinstance(a, argparse._HelpAction)]
        if not actions:
            continue
        title = "general" if group.title in ("options", "optional arguments") else group.title
        out.append(f"\n## {title}\n\n| flag | default | choices | meaning |\n|---|---|---|---|")
        for a in actions:
            flags = ", ".join(f"`{s}`" for s in a.option_strings)
            choices = ", ".join(str(c) for c in a.choices) if a.choices else ""
            out.append(f"| {flags} | {_cell(_default(a))} | {_cell(choices)} | {_cell(a.help or '')} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    check = "--check" in (sys.argv[1:] if argv is None else argv)
    text = render(build_parser())
    if check:
        if not DOC.is_file() or DOC.read_text() != text:
            print(f"{DOC} is stale: run python -m slime_corr.flag_docs", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
