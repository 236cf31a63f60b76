"""The documentation stays in step with the code: every public name is in the API reference, and
every relative link of README.md and docs/*.md points to a file that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import cpattn

ROOT = Path(__file__).resolve().parent.parent
API = ROOT / "docs" / "api.md"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _prose(text: str) -> str:
    """The text without fenced code blocks and inline code spans (no links live there)."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def _relative_links(path: Path) -> list[str]:
    links = []
    for target in _LINK.findall(_prose(path.read_text(encoding="utf-8"))):
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
            continue  # http(s):, mailto: ..., or an anchor in the same file
        links.append(target)
    return links


def test_all_has_no_duplicates_and_resolves():
    names = list(cpattn.__all__)
    duplicates = sorted({n for n in names if names.count(n) > 1})
    assert not duplicates, f"cpattn.__all__ lists these names more than once: {duplicates}"
    missing = [n for n in names if not hasattr(cpattn, n)]
    assert not missing, f"cpattn.__all__ names that cpattn does not define: {missing}"


@pytest.mark.parametrize("name", sorted(cpattn.__all__))
def test_public_name_is_in_api_reference(name):
    text = API.read_text(encoding="utf-8")
    as_code = f"`{name}`" in text
    as_heading = re.search(rf"^#+ .*\b{re.escape(name)}\b", text, re.M) is not None
    assert as_code or as_heading, f"docs/api.md does not document cpattn.{name} (as `{name}` or in a heading)"


@pytest.mark.parametrize("doc", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_relative_links_point_to_existing_files(doc):
    broken = []
    for target in _relative_links(doc):
        file_part = target.split("#", 1)[0]
        if file_part and not (doc.parent / file_part).exists():
            broken.append(target)
    assert not broken, f"{doc.relative_to(ROOT)} links to missing files: {broken}"


def test_link_scanner_finds_links():
    # guard against a regex that silently finds nothing
    assert any("docs/api.md" in link for link in _relative_links(ROOT / "README.md"))
