"""The docs site as a reader sees it, not only as the strict build accepts it: every page is
built with mkdocs into a temporary folder and its HTML read back. Markdown that Python-Markdown
did not render (a nested list under its 4-space rule, a list run into the paragraph above it, a
link or emphasis left as written) shows as text; a placeholder in angle brackets outside code
(``<commit>``) is taken for an HTML tag and vanishes from the text."""

from __future__ import annotations

import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

from support.helpers import ROOT

# The HTML elements the pages may contain; any other tag is Markdown's angle brackets lost.
HTML_TAGS = set(
    "a abbr article aside b blockquote br button caption code col colgroup dd del details dfn div dl "
    "dt em figcaption figure footer form h1 h2 h3 h4 h5 h6 header hr i img input kbd label li main "
    "mark nav ol p path pre rect s samp section small span strong sub summary sup svg table tbody td "
    "tfoot th thead tr u ul var".split()
)
# Text-level leaks: a list item run into a paragraph, link syntax, emphasis marks, a fence.
LEAKS = {
    "list marker": re.compile(r"\n[ \t]*(?:[-*+]|\d+\.) +\S"),
    "link syntax": re.compile(r"\]\([^)]*\)|\]\[[^\]]*\]"),
    "emphasis marks": re.compile(r"\*\*\S"),
    "code fence": re.compile(r"```"),
    "reST role": re.compile(r":(?:class|func|meth|mod|attr|exc|data|obj): CODE"),
}


class Article(HTMLParser):
    """The text of a page's article, code excluded, and the tags in it."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.depth = 0  # inside <article>
        self.code = 0  # inside <code> or <pre>
        self.quotes = 0  # <blockquote> depth
        self.nested_quote = False  # a quote in a quote: ">>>" lines of an example, not a quote
        self.text: list[str] = []
        self.tags: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag == "article":
            self.depth += 1
        elif self.depth:
            self.tags.add(tag)
            if tag == "blockquote":
                self.quotes += 1
                self.nested_quote |= self.quotes > 1
            if tag in ("code", "pre", "script", "style"):
                self.code += 1
                self.text.append(" CODE ")  # a word where the code was: not a marker's neighbour
            elif tag in ("p", "li", "td", "th", "dd", "dt", "h1", "h2", "h3", "h4", "div"):
                self.text.append("\x00")  # a block boundary: leaks are looked for within one block

    def handle_endtag(self, tag: str) -> None:
        if tag == "article":
            self.depth -= 1
        elif self.depth and tag in ("code", "pre", "script", "style"):
            self.code -= 1
        elif self.depth and tag == "blockquote":
            self.quotes -= 1

    def handle_data(self, data: str) -> None:
        if self.depth and not self.code:
            self.text.append(data)


def pages() -> list[str]:
    docs = ROOT / "docs"
    return sorted(str(p.relative_to(docs)) for p in docs.rglob("*.md") if "tools" not in p.parts)


def html_of(site: Path, page: str) -> Path:
    stem = page.removesuffix(".md")
    return site / ("index.html" if stem == "index" else f"{stem}/index.html")


@pytest.mark.parametrize("page", pages())
def test_page_renders_without_leaked_markdown(site, page):
    parsed = Article()
    parsed.feed(html_of(site, page).read_text())
    assert parsed.text, f"{page}: no article"
    blocks = "".join(parsed.text).split("\x00")
    leaks = [
        (kind, block.strip()[:160]) for block in blocks for kind, rx in LEAKS.items() if rx.search(block)
    ]
    assert leaks == [], f"{page}: Markdown left as text"
    assert not parsed.nested_quote, f"{page}: >>> lines rendered as nested quotes, not as code"
    unknown = parsed.tags - HTML_TAGS
    assert unknown == set(), f"{page}: angle brackets taken for HTML tags: {sorted(unknown)}"


def test_the_checks_find_what_they_look_for(docs_extra):
    """Each check fires on the bug it is for, as Python-Markdown renders it."""
    import markdown

    def rendered(text: str) -> Article:
        parsed = Article()
        parsed.feed(f"<article>{markdown.markdown(text)}</article>")
        return parsed

    collapsed = rendered("Where:\n- **Local directory**: read in place\n- **Hub**: fetched")
    assert any(LEAKS["list marker"].search(b) for b in "".join(collapsed.text).split("\x00"))
    assert rendered("Example:\n\n>>> plan = make_plan(ckpt)\n>>> plan.pp\n4").nested_quote
    assert "commit" in rendered("a path `x` then A17B/<commit>/vllm-pp4").tags
    assert LEAKS["reST role"].search("".join(rendered("returns a :class:`Plan`").text))
    assert LEAKS["link syntax"].search("".join(rendered("see [the page][nowhere] here").text))


def test_navigation_is_grouped_and_no_group_is_long(site):  # site: the docs extra is there
    """The nav: the home page, then Getting started, Guides, Reference and Development, each
    of at most ten pages (a flat list of twenty is not skimmable)."""
    import yaml

    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    assert nav[0] == {"Home": "index.md"}
    groups = {name: pages for entry in nav[1:] for name, pages in entry.items()}
    assert list(groups) == ["Getting started", "Guides", "Reference", "Development"]
    assert {name: len(pages) for name, pages in groups.items() if len(pages) > 10} == {}


def test_nested_lists_are_indented_as_python_markdown_needs():
    """A list item indented by 1-3 spaces is not nested under Python-Markdown (it needs 4): it
    renders as one more item of the outer list, silently. The sources are read for it."""
    found = []
    for page in pages():
        fence = False
        for number, line in enumerate((ROOT / "docs" / page).read_text().splitlines(), 1):
            fence ^= line.lstrip().startswith("```")
            if not fence and re.match(r" {1,3}(?:[-*+]|\d+\.) ", line):
                found.append(f"{page}:{number}: {line.strip()[:60]}")
    assert found == []
