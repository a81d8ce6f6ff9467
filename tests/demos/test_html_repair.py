"""repair_html: any string -> a well-formed HTML document (html.parser tree, re-serialised)."""

import random
import xml.etree.ElementTree as ET
from html.parser import HTMLParser

import pytest

from kimi_vl.data.screencast import page_html, random_page
from kimi_vl.demos.html_repair import repair_html

DOCTYPE = "<!DOCTYPE html>"
VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "param", "source", "track", "wbr"}


class _Balanced(HTMLParser):
    """Checks that every non-void start tag is closed in order."""

    def __init__(self):
        super().__init__()
        self.stack: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag not in VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        assert tag in VOID, f"<{tag}/> is not a void element"

    def handle_endtag(self, tag):
        assert self.stack and self.stack[-1] == tag, f"</{tag}> closes {self.stack}"
        self.stack.pop()


def check_document(doc: str) -> ET.Element:
    """Asserts the document is well-formed (HTML balance + XML parse) with html > head, body; returns the root."""
    assert doc.startswith(DOCTYPE)
    parser = _Balanced()
    parser.feed(doc)
    parser.close()
    assert parser.stack == []
    root = ET.fromstring(doc[len(DOCTYPE):])
    assert root.tag == "html" and [c.tag for c in root] == ["head", "body"]
    return root


@pytest.mark.parametrize("text", [
    "", None, b"", "   \n", "plain text", "<", "</", "<<>>", "</div></body></html>", "<html>", "<!-- unterminated",
    "<div><p>unclosed", '<div style="height:36px;backgr', "<html><body><div>abc</di", "<b>x</i></b></p>tail",
    '<a"b=c x>weird name</a"b>', "<p a=1 a=2 b>dup</p>", "\x00\x01\x02\ufffe\ud800 ctrl", b"\xff\xfe\x00\x80<div>\x00",
    "<style>a>b{color:red}</style><style>]]></style><title>T &amp; U</title>", "<table><tr><td>1<td>2</table>",
    "<![CDATA[x]]><?php echo 1 ?><!DOCTYPE foo>", "<![x]>a<![b", '<![!"', "<![if !IE]><p>x</p><![endif]>", "&lt;&gt;&amp;&#0;&#xD800;&bogus; & < >",
])
def test_repair_is_well_formed(text):
    check_document(repair_html(text))


def test_repair_of_random_garbage_and_idempotence():
    rng = random.Random(0)
    alphabet = '<>/="\' abdivphtmlbodystylescripttitle&;#x![]?-\x00\n'
    for _ in range(150):
        for text in (bytes(rng.randrange(256) for _ in range(rng.randint(0, 120))),
                     "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 120)))):
            doc = repair_html(text)
            check_document(doc)
            assert repair_html(doc) == doc


def test_truncated_page_keeps_its_content_and_closes_it():
    html = page_html(random_page(random.Random(4)))
    cut = html[: len(html) * 2 // 3]
    doc = repair_html(cut)
    root = check_document(doc)
    body = root.find("body")
    assert body.get("style") == "margin:0;font:10px sans-serif"
    assert body[0].tag == "div" and body[0].get("style").startswith("height:")
    # a complete page comes back as the same tree, only wrapped in the standard document shell
    full = repair_html(html)
    check_document(full)
    assert full == DOCTYPE + '<html><head><meta charset="utf-8"/></head>' + html[len("<html>"):]


@pytest.mark.parametrize(("cut", "tag", "text"), [
    ("<style>body{margin:0}.h{background:navy;height:80px}", "style", "body{margin:0}.h{background:navy;height:80px}"),
    ("<style>p{color:red}</sty", "style", "p{color:red}"),
    ("<title>My shop &amp; more", "title", "My shop & more"),
    ("<div><textarea>typed so far</", "textarea", "typed so far"),
])
def test_output_cut_inside_a_raw_text_element_keeps_its_text(cut, tag, text):
    """A reply cut (max_new_tokens) inside a stylesheet keeps the rules written so far, as a browser does, rather
    than losing the whole stylesheet; an unfinished end tag at the cut is dropped."""
    root = check_document(repair_html(cut))
    assert root.find(f".//{tag}").text == text


def test_repair_removes_active_content():
    doc = repair_html('<div onclick="x()">a<script>alert(1)</script><iframe src="y"></iframe>'
                      '<a href=" javascript:alert(2)">l</a><img src="p.png" onerror="z()"></div>')
    check_document(doc)
    for bad in ("script", "alert", "iframe", "onclick", "onerror", "javascript"):
        assert bad not in doc
    assert '<img src="p.png"/>' in doc and "<a>l</a>" in doc


def test_repair_removes_refresh_redirects():
    """`<meta http-equiv="refresh">` would reload the page or navigate the renderer elsewhere (a local folder, a
    remote site) before the screenshot; other meta elements stay."""
    doc = repair_html('<meta http-equiv="Refresh" content="0;url=file:///etc/"><meta http-equiv="refresh" content="1">'
                      '<meta name="viewport" content="width=device-width"><div>page</div>')
    head, body = check_document(doc)
    assert "refresh" not in doc.lower() and "/etc/" not in doc
    assert [e.get("name") for e in head] == [None, "viewport"] and body[0].text == "page"


def test_head_elements_and_text_escaping():
    doc = repair_html("<title>a<b</title><style>p{color:red}</style>x < y & z<br>")
    root = check_document(doc)
    head, body = root
    assert [e.tag for e in head] == ["meta", "title", "style"]
    assert head.find("title").text == "a<b" and head.find("style").text == "p{color:red}"
    assert body.text == "x < y & z" and body[0].tag == "br"


def test_deeply_nested_output_is_repaired():
    """A model stuck repeating `<div>` (a greedy loop) nests its elements deeper than Python's recursion limit: the
    document still comes back, every element closed."""
    depth = 5000
    doc = repair_html("<div>" * depth + "x")
    assert doc.endswith("x" + "</div>" * depth + "</body></html>")
    root = ET.fromstring(doc[len(DOCTYPE):])
    assert sum(1 for _ in root.iter("div")) == depth
