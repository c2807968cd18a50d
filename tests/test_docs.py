"""The docs: `docs/` builds as a site offline with warnings as errors, every Python block in the docs and the
README compiles and names only what monarch has, and no link in the repo points outside it."""

import ast
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO

PYTHON = {"python", "py", "python3"}
"""Code blocks compiled (IPython magic lines, `%%mesh`, `%env`, `!cmd`, are left out first)."""
UNCHECKED = {"bash", "text"}
"""Code blocks that are not Python: shell commands, diagrams, output. Any other language is refused, so
that no Python block escapes the check by an odd name."""
SKIP_DIRS = {".git", ".venv", "build", "dist", "site", "test-artifacts", "node_modules"}
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<lang>[\w+-]*)")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def _repo_files() -> list[str]:
    """The repo's files, relative paths: tracked and new ones git does not ignore (else a walk)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout
        return [p for p in out.splitlines() if os.path.exists(os.path.join(REPO, p))]
    except (OSError, subprocess.CalledProcessError):
        found = []
        for root, dirs, files in os.walk(REPO):
            dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.startswith(".")]
            found += [os.path.relpath(os.path.join(root, f), REPO) for f in files]
        return found


def _markdown() -> list[str]:
    return sorted(p for p in _repo_files() if p.endswith(".md"))


def _docs_pages() -> list[str]:
    pages = ["README.md"]
    for root, _, files in os.walk(os.path.join(REPO, "docs")):
        pages += [os.path.relpath(os.path.join(root, f), REPO) for f in files if f.endswith(".md")]
    return sorted(pages)


def code_blocks(text: str) -> list[tuple[str, int, str]]:
    """(language, line of the block's first line, source) of each fenced block; an indented fence (in a
    list item) has its indent taken off its lines."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m["indent"], m["fence"], m["lang"].lower()
        first, body = i + 2, []
        i += 1
        while i < len(lines):
            s = lines[i].strip()
            if s.startswith(fence) and set(s) == {fence[0]}:
                break
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        blocks.append((lang, first, "\n".join(body) + "\n"))
        i += 1
    return blocks


def without_code(text: str) -> str:
    """`text` with its fenced blocks and inline code spans blanked (links inside code are code)."""
    lines = text.splitlines()
    keep, inside = [], None
    for line in lines:
        m = FENCE.match(line)
        if inside is None and m:
            inside = m["fence"]
            keep.append("")
        elif inside is not None:
            s = line.strip()
            if s.startswith(inside) and set(s) == {inside[0]}:
                inside = None
            keep.append("")
        else:
            keep.append(re.sub(r"``.*?``|`[^`]*`", "", line))
    return "\n".join(keep)


def strip_magics(source: str) -> str:
    """IPython's magics and shell escapes as `pass` at their indent (line numbers kept)."""
    out = []
    for line in source.splitlines():
        body = line.lstrip()
        out.append(line[: len(line) - len(body)] + "pass" if body.startswith(("%", "!")) else line)
    return "\n".join(out) + "\n"


def monarch_names(tree: ast.AST) -> set[str]:
    """Dotted names of monarch's API a block uses: `from monarch.x import y`, `import monarch.x`, and
    attribute chains on the name `monarch` (`monarch.notebook.job`)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "monarch":
            names.update(f"{node.module}.{a.name}" for a in node.names if a.name != "*")
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.split(".")[0] == "monarch")
        elif isinstance(node, ast.Attribute):
            parts, value = [node.attr], node.value
            while isinstance(value, ast.Attribute):
                parts.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id == "monarch":
                names.add(".".join(["monarch", *reversed(parts)]))
    return names


@pytest.mark.timeout(300)
def test_the_site_builds_offline_with_warnings_as_errors(tmp_path):
    try:
        import material  # noqa: F401
        import mkdocs  # noqa: F401
    except ImportError:
        pytest.fail('mkdocs-material is a test dependency: pip install -e ".[test]"')
    site = tmp_path / "site"
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")  # (material's notice about its own future, not a warning)
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "WARNING" not in proc.stderr, proc.stderr
    pages = [os.path.join(r, f) for r, _, fs in os.walk(site) for f in fs if f.endswith(".html")]
    assert len(pages) >= len(_docs_pages()) - 1  # every docs page (the README is not one)
    outside = re.compile(r"""<(?:link|script|img)\b[^>]*\b(?:href|src)=["']?(?:https?:)?//""", re.I)
    for page in pages:
        with open(page, encoding="utf-8") as f:
            html = f.read()
        assert not outside.search(html), f"{page} loads something from another site"


@pytest.mark.timeout(120)
def test_every_code_block_compiles_and_names_only_what_monarch_has(tmp_path):
    names: dict[str, list[str]] = {}
    compiled = 0
    for rel in _docs_pages():
        with open(os.path.join(REPO, rel), encoding="utf-8") as f:
            text = f.read()
        for lang, line, source in code_blocks(text):
            where = f"{rel}:{line}"
            assert lang, f"{where}: a code block without a language; mark it python, bash or text"
            if lang in UNCHECKED:
                continue
            assert lang in PYTHON, f"{where}: code blocks are {sorted(PYTHON | UNCHECKED)}, not {lang!r}"
            plain = strip_magics(source)
            try:
                compile(plain, where, "exec")
            except SyntaxError as e:
                pytest.fail(f"{rel}:{line + (e.lineno or 1) - 1}: {e.msg}\n{source}")
            compiled += 1
            for name in monarch_names(ast.parse(plain)):
                names.setdefault(name, []).append(where)
    assert compiled >= 10, "the docs' examples were not found"
    # Resolve the names against this checkout: a tree shaped like the installed package (as ./run's import
    # check builds it), imported in a fresh interpreter from inside it (the checkout's own monarch/ folder,
    # which lacks runtime/, must not shadow it).
    tree = tmp_path / "tree"
    package = tree / "monarch"
    package.mkdir(parents=True)
    for f in os.listdir(os.path.join(REPO, "monarch")):
        if f.endswith(".py"):
            os.symlink(os.path.join(REPO, "monarch", f), package / f)
    for d in ("runtime", "kernel", "extension", "widgets"):
        os.symlink(os.path.join(REPO, d), package / d)
    resolve = (
        "import importlib, sys\n"
        "for dotted in sys.argv[1:]:\n"
        "    parts = dotted.split('.')\n"
        "    try:\n"
        "        obj = importlib.import_module(parts[0])\n"
        "        for i, part in enumerate(parts[1:], 2):\n"
        "            try:\n"
        "                obj = getattr(obj, part)\n"
        "            except AttributeError:\n"
        "                try:\n"
        "                    obj = importlib.import_module('.'.join(parts[:i]))\n"
        "                except ModuleNotFoundError as e:\n"
        "                    if e.name != '.'.join(parts[:i]):\n"
        "                        raise\n"
        "                    raise LookupError(f\"{'.'.join(parts[:i - 1])} has no {part!r}\") from None\n"
        "    except Exception as e:\n"
        "        print(f'{dotted}: {type(e).__name__}: {e}')\n"
    )
    env = dict(os.environ, PYTHONPATH=str(tree))
    proc = subprocess.run(
        [sys.executable, "-c", resolve, *sorted(names)], cwd=tree, env=env, capture_output=True, text=True, timeout=100
    )
    assert proc.returncode == 0, proc.stderr
    missing = [f"{line}  (used at {', '.join(names[line.split(':')[0]])})" for line in proc.stdout.splitlines()]
    assert missing == [], "\n".join(missing)


def test_no_link_points_outside_the_repo():
    problems = []
    for rel in [*_markdown(), ".importlinter"]:
        with open(os.path.join(REPO, rel), encoding="utf-8") as f:
            text = f.read()
        for bad in ("../shared", "DESIGN.md"):
            if bad in text:
                problems.append(f"{rel}: names {bad} (outside the repo; link into docs/ instead)")
        if not rel.endswith(".md"):
            continue
        prose = without_code(text)
        base = os.path.dirname(os.path.join(REPO, rel))
        for target in LINK.findall(prose) + REFERENCE.findall(prose):
            if target.startswith("#"):
                continue  # (an anchor on the same page: mkdocs checks those of docs/)
            if SCHEME.match(target) or target.startswith(("/", "//")):
                problems.append(f"{rel}: links to {target}, outside the repo")
                continue
            path = os.path.normpath(os.path.join(base, target.split("#")[0]))
            if os.path.commonpath([path, REPO]) != REPO:
                problems.append(f"{rel}: links to {target}, outside the repo")
            elif not os.path.exists(path):
                problems.append(f"{rel}: links to {target}, which does not exist")
    assert problems == [], "\n".join(problems)


def test_the_readme_is_a_front_door():
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        lines = f.read().splitlines()
    assert len(lines) <= 90, f"README.md has {len(lines)} lines: keep it a front door, the rest goes in docs/"
    links = LINK.findall(without_code("\n".join(lines)))
    assert any(t.startswith("docs/") for t in links), "the README links into docs/"
