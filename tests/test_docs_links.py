"""The README and the `docs/` pages: a short front door, and no link that leads nowhere.

Every relative markdown link in README.md and docs/*.md names a file that exists, and its
`#anchor`, if any, is a heading of the target (GitHub's slugs); README.md stays a front
door of at most 300 lines."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
# [text](target) and ![alt](target); the target has no spaces (a title after one is dropped)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+[^)]*)?\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)[ \t#]*$", re.M)


def prose(text: str) -> str:
    """The text outside fenced code blocks (a `# comment` in a shell block is no heading)."""
    return FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text, lowercased, without punctuation
    but `-` and `_`, spaces as hyphens."""
    text = CODE_SPAN.sub(lambda m: m.group(2), heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link's text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.replace("*", "").replace("~", "")
    text = re.sub(r"(?<!\w)_+|_+(?!\w)", "", text)  # emphasis underscores, not snake_case
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor, repeats numbered as GitHub numbers them (`x`, `x-1`, …)."""
    seen: dict[str, int] = {}
    out = set()
    for m in HEADING.finditer(prose(path.read_text(encoding="utf-8"))):
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[str]:
    text = CODE_SPAN.sub("", prose(path.read_text(encoding="utf-8")))
    return [m.group(1) for m in LINK.finditer(text)]


def test_slugs_follow_github() -> None:
    assert slug("Speculative decoding (`--speculative mtp`)") == (
        "speculative-decoding---speculative-mtp"
    )
    assert slug("llama.cpp, the peer to beat") == "llamacpp-the-peer-to-beat"
    assert slug("`GET /metrics`") == "get-metrics"
    assert slug("Use with Codex CLI and the openai SDK") == "use-with-codex-cli-and-the-openai-sdk"
    assert slug("state_dtype and *emphasis*") == "state_dtype-and-emphasis"


def test_the_checker_sees_links_and_skips_code() -> None:
    page = ROOT / "docs" / "clients.md"
    found = links(page)
    assert "requests.md" in found
    assert not any("model_dump" in target for target in found)  # python in a code block


def test_readme_is_a_front_door() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= 300, f"README.md has {lines} lines: move a subject into docs/"
    assert len(PAGES) > 10  # the subjects live in docs/


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto:, …
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{target}: no file {os.path.relpath(dest, ROOT)}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {os.path.relpath(dest, ROOT)}")
    assert not broken, "\n".join(broken)


def test_architecture_names_every_module() -> None:
    """A newcomer following docs/architecture.md through the code meets no module it does
    not name: every module of `ds4jax/` and `serve/` is named there, in its package's line."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    missing = [
        str(path.relative_to(ROOT))
        for package in ("ds4jax", "serve")
        for path in sorted((ROOT / package).rglob("*.py"))
        if path.name != "__init__.py"
        and f"`{path.name}`" not in text
        and f"{path.parent.name}/{path.name}`" not in text
    ]
    assert not missing, f"docs/architecture.md does not name: {missing}"
