"""Bench results as markdown tables in docs/benchmarks.md, one block per script between its markers.

A script with `--markdown FILE` builds its table (header, rows) and one caption line (`caption_line`: the exact
command, the machine, the date and what the script adds), then `write_block` rewrites the text between

    <!-- bench/NAME: begin -->
    <!-- bench/NAME: end -->

in FILE (NAME: the script's file name, e.g. `vs_verl.py`), or appends a `## ` section holding a new block where the
markers are absent. Everything between the markers is the script's: a rerun replaces it.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
from collections.abc import Iterable, Sequence
from pathlib import Path

# environment variables that change what a bench measures; those set are written before the command
ENV_PREFIXES = ("MALLOC_", "OMP_NUM_THREADS", "TRITON_INTERPRET")


def markers(name: str) -> tuple[str, str]:
    return f"<!-- bench/{name}: begin -->", f"<!-- bench/{name}: end -->"


def command(argv: Sequence[str], env: dict[str, str] | None = None) -> str:
    """`python bench/X.py ARGS` as it was run (argv = sys.argv), after the benchmark-relevant variables set in
    `env` (default os.environ)."""
    env = os.environ if env is None else env
    prefix = [f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()) if k.startswith(ENV_PREFIXES)]
    return " ".join([*prefix, "python", f"bench/{Path(argv[0]).name}", *(shlex.quote(a) for a in argv[1:])])


def caption_line(argv: Sequence[str], device: str, threads: int, extra: str = "") -> str:
    """One line: the command in backticks, the device, torch threads, the machine (processor, CPU count), the ISO
    date, then `extra` (what the script adds: repeats, versions, sizes)."""
    machine = platform.processor() or platform.machine()
    line = (f"`{command(argv)}` on {device}, {threads} torch thread(s), {machine}, {os.cpu_count()} CPUs, "
            f"{datetime.date.today().isoformat()}")
    return f"{line}; {extra}" if extra else line


def _cell(value: object) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def table(caption: str, header: Sequence[object], rows: Iterable[Sequence[object]]) -> str:
    """The caption line, a blank line, then the markdown table."""
    lines = [caption, "", "| " + " | ".join(_cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_block(path: str | Path, name: str, caption: str, header: Sequence[object],
                rows: Iterable[Sequence[object]], title: str | None = None) -> None:
    """Rewrite bench/NAME's block in `path` with the table; where its markers are absent, append a section
    (`## TITLE`, default `bench/NAME`) holding the block. A missing file is created."""
    path = Path(path)
    text = path.read_text() if path.exists() else ""
    begin, end = markers(name)
    block = f"{begin}\n{table(caption, header, rows)}\n{end}"
    if begin in text and end in text[text.index(begin):]:
        start = text.index(begin)
        stop = text.index(end, start) + len(end)
        text = text[:start] + block + text[stop:]
    else:
        section = f"## {title or f'bench/{name}'}\n\n{block}\n"
        text = text.rstrip() + "\n\n" + section if text.strip() else section
    path.write_text(text)
