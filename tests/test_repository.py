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


# --------------------------------------------------------------------------------------------
# The README's examples name what the code has


def python_blocks(text: str) -> list[tuple[int, str]]:
    """Every fenced ```python block of a Markdown text, as (the line it starts on, its code)."""
    return [(text[:m.start()].count("\n") + 2, m.group(1))
            for m in re.finditer(r"^```python\n(.*?)^```", text, re.MULTILINE | re.DOTALL)]


def unresolved(code: str) -> list[str]:
    """What a snippet names of weightsync that does not exist: a module or a name imported from it, an attribute of
    an imported weightsync module, a keyword a weightsync callable does not take. Names needing a library that is
    not installed here (vLLM, SGLang) are not judged."""
    import ast
    import dataclasses
    import importlib
    import inspect

    def load(module: str):
        try:
            return importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name and not e.name.startswith("weightsync"):
                return None  # an engine not installed here
            raise

    found: list[str] = []
    names: dict[str, object] = {}  # what the snippet's names are bound to
    tree = ast.parse(code)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("weightsync"):
            try:
                module = load(node.module)
            except ImportError as e:
                found.append(f"from {node.module} import ...: {e}")
                continue
            for a in node.names:
                if module is None:
                    continue
                try:
                    names[a.asname or a.name] = getattr(module, a.name)
                except AttributeError:
                    found.append(f"{node.module} has no {a.name}")
                except ModuleNotFoundError as e:  # a lazy name whose module needs an engine not installed here
                    if not (e.name or "").startswith("weightsync"):
                        continue
                    found.append(f"{node.module}.{a.name}: {e}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("weightsync"):
                    try:
                        module = load(a.name)
                    except ImportError as e:
                        found.append(f"import {a.name}: {e}")
                        continue
                    if a.asname and module is not None:
                        names[a.asname] = module
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in names:
            owner = names[node.value.id]
            if inspect.ismodule(owner):
                try:
                    getattr(owner, node.attr)
                except AttributeError:
                    found.append(f"{owner.__name__} has no {node.attr}")
                except ModuleNotFoundError:
                    pass
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.keywords:
            continue
        f = node.func
        target = None
        if isinstance(f, ast.Name):
            target = names.get(f.id)
        elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and inspect.ismodule(names.get(f.value.id)):
            try:
                target = getattr(names[f.value.id], f.attr)
            except (AttributeError, ModuleNotFoundError):
                target = None
        if target is None or not callable(target):
            continue
        params = inspect.signature(target).parameters
        accepted = {n for n, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        if any(p.kind is p.VAR_KEYWORD for p in params.values()):
            options = getattr(target, "OPTIONS", None) or _options_of(target)
            if options is None:
                continue
            accepted |= {fl.name for fl in dataclasses.fields(options)}
        for k in node.keywords:
            if k.arg is not None and k.arg not in accepted:
                found.append(f"{getattr(target, '__qualname__', target)} takes no {k.arg}=")
    return found


def _options_of(target) -> object | None:
    """The dataclass a ``**options`` callable passes its keywords to (VLLMWeightSync: InitInfo), or None."""
    if getattr(target, "__qualname__", "") == "VLLMWeightSync":
        from weightsync.vllm.config import InitInfo

        return InitInfo
    return None


def test_the_readme_s_python_examples_parse_and_name_only_what_exists():
    """Tried as a new user would, the README's snippets did not work verbatim: the vLLM ones passed no token, steps
    were numbered from 0 by the trainer and from 1 by the engines. Each ```python block must parse, import only
    weightsync names that exist, and pass only keywords their callables take; every example loops over the same
    steps, and every participant is given the job's token."""
    assert len(python_blocks((ROOT / "README.md").read_text())) >= 6, "the README has an example per trainer and engine"
    problems, loops = [], set()
    for doc in ("README.md", "docs/usage.md"):  # the README and the reference behind it
        for line, code in python_blocks((ROOT / doc).read_text()):
            try:
                compile(code, f"{doc}:{line}", "exec")
            except SyntaxError as e:
                problems.append(f"{doc}:{line}: {e}")
                continue
            problems += [f"{doc}:{line}: {p}" for p in unresolved(code)]
            loops |= set(re.findall(r"for step in (range\([^)]*\)+)", code))
            for call in re.findall(r"\b(WeightWriter|WeightReader|VLLMWeightSync)\((.*?)\)\.connect\(\)", code,
                                   re.DOTALL):
                if "token=" not in call[1]:
                    problems.append(f"{doc}:{line}: {call[0]}(...) without token=")
    assert not problems, "\n".join(problems)
    assert loops == {"range(1, steps + 1)"}, f"the examples number steps differently: {loops}"


def test_the_checker_finds_names_and_keywords_that_do_not_exist():
    assert unresolved("from weightsync import WeightWriter\nWeightWriter(t, meta='u', job='j', token='x')") == []
    assert unresolved("from weightsync import NoSuchThing") == ["weightsync has no NoSuchThing"]
    assert unresolved("from weightsync import WeightReader\nWeightReader(i, meta='u', job='j', tokn='x')") == [
        "WeightReader takes no tokn="]
    wv = unresolved("import weightsync.vllm as wv\nwv.VLLMWeightSync(llm, meta='u', job='j', token='t', nope=1)\n"
                    "wv.NOPE")
    assert "weightsync.vllm has no NOPE" in wv, wv
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:  # (without vLLM its names are not judged)
        assert "VLLMWeightSync takes no nope=" in wv, wv
    assert unresolved("from weightsync.instances.sglang import SGLangInstance\nSGLangInstance(e, bad=1)") == [
        "SGLangInstance takes no bad="]


def test_the_readme_lists_every_preset():
    """Before: the presets list omitted ``tiny-qwen3-h64``, which the README's own example used."""
    from weightsync.spec.model import preset_names

    text = (ROOT / "README.md").read_text()
    missing = [p for p in preset_names() if f"`{p}`" not in text]
    assert not missing, f"README.md's presets list lacks {missing}"
