"""Turn any model output into a well-formed, static HTML document, with the standard library's `html.parser`.

`repair_html(text)` parses `text` into a tree and serialises the tree again, so the result is well-formed whatever the
input (empty, truncated, malformed, binary garbage):

- Start tags open elements; an end tag closes the innermost open element of that name together with the elements
  opened inside it (they were left unclosed); an end tag that matches no open element is dropped. Elements still open
  at the end are closed there. Void elements (`br`, `img`, `meta`, ...) never hold content.
- An unfinished tag at the very end (a truncated output such as `<div style="heigh`) is dropped, not shown as text.
  An output cut inside a `style`, `title` or `textarea` element keeps the text written so far as its content (as
  browsers do), less an unfinished end tag.
- The document is always `<!DOCTYPE html><html><head><meta charset="utf-8">...</head><body>...</body></html>`:
  `html`, `head` and `body` tags of the input only mark where content goes (the first attributes seen on `html` and
  `body` are kept, e.g. `<body style="margin:0">`); `title`, `style`, `meta`, `link` and `base` elements go to the
  head, everything else to the body.
- The page is static: `script`, `iframe`, `object`, `embed` elements (with their content), refresh redirects
  (`<meta http-equiv="refresh">`), `on*` event attributes and `javascript:` URLs are removed. Comments, processing
  instructions and declarations are dropped.
- Names are kept only when they are valid XML names made of ASCII letters, digits, `-`, `_`, `.`, `:` (an element
  with another name is unwrapped: its content is kept); duplicate attributes keep the first value; text and
  attribute values are escaped; characters XML 1.0 forbids (NUL and other C0 controls, lone surrogates, U+FFFE/F)
  are removed; `<` and `&` are removed from `style` text (CSS needs neither). `title` and `textarea` hold text
  only, up to their end tag (as browsers read them).

The output is both HTML5 and well-formed XML (void elements are written `<br/>`): `xml.etree.ElementTree` parses
everything after the doctype.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from html.parser import HTMLParser

__all__ = ["repair_html"]

VOID = frozenset("area base br col embed hr img input link meta param source track wbr".split())
RCDATA = frozenset(["title", "textarea"])
HEAD_TAGS = frozenset(["title", "style", "meta", "link", "base"])
DROPPED = frozenset(["script", "iframe", "object", "embed", "frame", "frameset", "noscript", "template"])
_NAME_START = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_")
_NAME_CHARS = _NAME_START | frozenset("0123456789-.:")
_URL_ATTRS = frozenset(["href", "src", "action", "formaction", "xlink:href", "background", "poster", "data"])


def _valid_name(name: str) -> bool:
    return bool(name) and name[0] in _NAME_START and all(c in _NAME_CHARS for c in name)


def _xml_char(c: str) -> bool:
    o = ord(c)
    return (
        o in (0x9, 0xA, 0xD)
        or 0x20 <= o <= 0xD7FF
        or 0xE000 <= o <= 0xFFFD
        or 0x10000 <= o <= 0x10FFFF
    )


def _clean(text: str) -> str:
    return "".join(c for c in text if _xml_char(c))


@dataclass
class _Element:
    tag: str
    attrs: list[tuple[str, str]] = field(default_factory=list)
    children: list[_Element | str] = field(default_factory=list)


def _safe_attrs(attrs: list[tuple[str, str | None]]) -> list[tuple[str, str]]:
    kept: list[tuple[str, str]] = []
    seen: set[str] = set()
    for name, value in attrs:
        name = name.lower()
        if not _valid_name(name) or name in seen or name.startswith("on"):
            continue
        value = _clean(value or "")
        if name in _URL_ATTRS and "".join(value.split()).lower().startswith(("javascript:", "vbscript:")):
            continue
        seen.add(name)
        kept.append((name, value))
    return kept


class _TreeBuilder(HTMLParser):
    """Builds `head` and `body` element lists from a tag soup (see the module docstring for the rules)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.head = _Element("head")
        self.body = _Element("body")
        self.html_attrs: list[tuple[str, str]] | None = None
        self.stack: list[_Element] = []  # open elements below head/body
        self.skip_depth = 0  # > 0 inside a dropped element (script, iframe, ...)
        self.skip_tag = ""

    # -- helpers
    def _parent(self) -> _Element:
        return self.stack[-1] if self.stack else self.body

    def _open(self, tag: str, attrs: list[tuple[str, str | None]], self_closing: bool) -> None:
        if self.skip_depth:
            if tag == self.skip_tag and not self_closing:
                self.skip_depth += 1
            return
        if tag in DROPPED:
            if not self_closing and tag not in VOID:
                self.skip_depth, self.skip_tag = 1, tag
            return
        if tag == "meta" and any(name == "http-equiv" and (value or "").strip().lower() == "refresh"
                                 for name, value in attrs):
            return  # a timed reload or redirect (e.g. to a local file): the page would not stay static
        if tag == "html":
            if self.html_attrs is None:
                self.html_attrs = _safe_attrs(attrs)
            return
        if tag == "body":
            if not self.body.attrs:
                self.body.attrs = _safe_attrs(attrs)
            return
        if tag == "head" or not _valid_name(tag):
            return  # structural marker / unwrapped element: its content goes where it would anyway
        element = _Element(tag, _safe_attrs(attrs))
        if tag in HEAD_TAGS and not self.stack:
            self.head.children.append(element)
        else:
            self._parent().children.append(element)
        if tag not in VOID and not self_closing:
            self.stack.append(element)
            if tag in RCDATA:
                self.set_cdata_mode(tag)  # text up to </title> (</textarea>), as browsers read it

    # -- HTMLParser callbacks
    def parse_marked_section(self, i: int, report: int = 1) -> int:
        """`<![...` (CDATA or conditional sections): browsers read it as a bogus comment up to the next `>`; it is
        skipped (the standard library's version raises on unknown keywords)."""
        j = self.rawdata.find(">", i + 3)
        return -1 if j < 0 else j + 1

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self._open(tag, attrs, self_closing=False)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self._open(tag, attrs, self_closing=True)

    def handle_endtag(self, tag: str) -> None:
        if self.skip_depth:
            if tag == self.skip_tag:
                self.skip_depth -= 1
            return
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i].tag == tag:
                del self.stack[i:]
                return
        # a stray closer (or </html>, </head>, </body>): dropped

    def handle_data(self, data: str) -> None:
        if self.skip_depth or not data:
            return
        data = _clean(data)
        if not data:
            return
        parent = self._parent()
        if parent.tag in RCDATA:
            data = _clean(html.unescape(data))  # cdata mode hands over character references undecoded
        if parent.tag == "style":
            data = data.replace("<", "").replace("&", "")
        if not self.stack and not data.strip() and not self.body.children:
            return  # whitespace before any content
        if parent.children and isinstance(parent.children[-1], str):
            parent.children[-1] += data
        else:
            parent.children.append(data)


def _serialise(root: _Element, out: list[str]) -> None:
    """Append the HTML of `root` and everything in it to `out`; iterative, so any nesting depth serialises."""
    pending: list[tuple[_Element | str, bool] | str] = [(root, False)]  # (node, inside style) or an end tag
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            out.append(item)
            continue
        node, raw_text = item
        if isinstance(node, str):
            out.append(node.replace("]]>", "]] >") if raw_text else html.escape(node, quote=False))
            continue
        attrs = "".join(f' {name}="{html.escape(value, quote=True)}"' for name, value in node.attrs)
        if node.tag in VOID:
            out.append(f"<{node.tag}{attrs}/>")
            continue
        out.append(f"<{node.tag}{attrs}>")
        pending.append(f"</{node.tag}>")
        pending.extend((child, node.tag == "style") for child in reversed(node.children))


def _raw_text_tail(text: str, tag: str) -> str:
    """The text of a `tag` element (`style`, `title`, `textarea`) cut off by the end of the input, less an
    unfinished end tag at its end (`</sty`)."""
    cut = text.rfind("</")
    return text[:cut] if cut >= 0 and f"</{tag}".startswith(text[cut:].lower()) else text


def repair_html(text: str | bytes | None) -> str:
    """A well-formed HTML document from any string (see the module docstring for the rules).

    Args:
        text: model output; bytes are decoded as UTF-8 with replacement characters, None is the empty string.

    Returns:
        `<!DOCTYPE html><html><head><meta charset="utf-8">...</head><body>...</body></html>`.
    """
    if text is None:
        text = ""
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text).decode("utf-8", errors="replace")
    builder = _TreeBuilder()
    builder.feed(str(text))
    leftover = builder.rawdata  # what feed() could not parse yet: an unfinished tag, comment or text
    if builder.cdata_elem is not None:  # cut inside `style`, `title` or `textarea`: its text so far is its content
        builder.rawdata = ""
        builder.handle_data(_raw_text_tail(leftover, builder.cdata_elem))
    elif leftover.lstrip().startswith("<"):
        builder.rawdata = ""  # an unfinished tag at the end (truncated output): dropped
    builder.close()
    head = builder.head
    if not any(isinstance(c, _Element) and c.tag == "meta" and ("charset", "utf-8") in c.attrs
               for c in head.children):
        head.children.insert(0, _Element("meta", [("charset", "utf-8")]))
    out = ["<!DOCTYPE html>"]
    html_attrs = "".join(f' {n}="{html.escape(v, quote=True)}"' for n, v in builder.html_attrs or [])
    out.append(f"<html{html_attrs}>")
    _serialise(head, out)
    _serialise(builder.body, out)
    out.append("</html>")
    return "".join(out)
