"""The repository speaks of the project by dates and commits: no tracked file numbers the periods it was worked in.

A measurement, a change or a host is named by when it ran and at which commit ("2026-12-06, at ``cc55ce7``"), never
by the word session and a number. The check reads every file ``git ls-files`` lists (text only: a file with a NUL byte or that is not
UTF-8 is skipped) and every tracked path, and names each ``file:line`` where one is left.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: the word session (or sessions, any case), a space and a digit: a numbered work period (``session.py``, "the job
#: session" are not)
SESSION_WORD = re.compile(r"\bsessions? [0-9]", re.IGNORECASE)
#: a path with the word and a digit (how some result files were once named)
SESSION_PATH = re.compile(r"session[-_ ]?[0-9]", re.IGNORECASE)


def tracked(root: Path = ROOT) -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout (or no git): the tracked files are unknown")
    return [p for p in out.decode().split("\0") if p]


def session_words(root: Path, paths: list[str]) -> list[str]:
    """``path:line: text`` for every line of a tracked text file with a numbered session, and ``path`` for every
    tracked path that has one."""
    found = [f"{p} (path)" for p in paths if SESSION_PATH.search(p)]
    for p in paths:
        f = root / p
        if not f.is_file() or f.is_symlink():
            continue  # deleted in the work tree, or a link (its target is checked where it is tracked)
        data = f.read_bytes()
        if b"\0" in data:
            continue
        try:
            text = data.decode()
        except UnicodeDecodeError:
            continue
        if not SESSION_WORD.search(text):
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if SESSION_WORD.search(line):
                found.append(f"{p}:{n}: {line.strip()[:160]}")
    return found


def test_no_numbered_sessions_in_tracked_files():
    found = session_words(ROOT, tracked())
    assert not found, (f"{len(found)} place(s) name a numbered session; say the date and the commit instead "
                       "(BENCHMARKS.md's headings: \"2026-12-06: ...\"):\n  " + "\n  ".join(found))


def test_the_check_finds_what_it_must_and_nothing_else(tmp_path):
    """The checker itself: numbered sessions in any case, singular or plural, in text and in paths, each named by
    file and line; the job session, ``session.py``, a binary file and a file that is not UTF-8 pass."""
    # the examples are built, so that this file has none itself
    (tmp_path / "a.md").write_text("fine\n" + "Session " + "15 (2026-12-06): heading\nas in sessions " + "12-16\n")
    (tmp_path / "b.py").write_text("from weightsync.runtime import session  # the job session's terms\nx = 1\n")
    (tmp_path / "c.bin").write_bytes(b"\0session " + b"9")
    (tmp_path / "d.txt").write_bytes(b"\xffsession " + b"9")
    bad_path = "run-session" + "2.json"
    (tmp_path / bad_path).write_text("{}")
    found = session_words(tmp_path, ["a.md", "b.py", "c.bin", "d.txt", bad_path, "gone.md"])
    assert found == [f"{bad_path} (path)", "a.md:2: " + "Session " + "15 (2026-12-06): heading",
                     "a.md:3: as in sessions " + "12-16"]
