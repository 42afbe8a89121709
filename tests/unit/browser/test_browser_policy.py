"""Pure checks of chv-browser: URL allow-list, names, truncation."""
from hypothesis import given
from hypothesis import strategies as st
import pytest

from chv_guest.browser.policy import Refused, check_name, check_slot, check_url, truncate


@pytest.mark.parametrize("url", ["http://127.0.0.1:8080/", "https://example.org/a?b#c", "HTTPS://EXAMPLE.ORG"])
def test_http_and_https_allowed(url):
    assert check_url(url)


@pytest.mark.parametrize("url", ["file:///etc/passwd", "data:text/html,<h1>x</h1>", "javascript:alert(1)",
                                 "chrome://version", "about:blank", "view-source:http://x/", "ftp://x/",
                                 "http://", "https:///path", "", None, 5, "ws://x/", "blob:http://x/1",
                                 "  file:///x", "filesystem:http://x/temporary/a"])
def test_everything_else_refused(url):
    with pytest.raises(Refused):
        check_url(url)


@pytest.mark.parametrize("name", ["../x", "a/b", ".hidden", "", "x" * 65, "a..b", "a\x00", None, "é"])
def test_bad_names_and_slots(name):
    with pytest.raises(Refused):
        check_name(name)
    with pytest.raises(Refused):
        check_slot(name)


def test_good_name():
    assert check_name("shot-1.final") == "shot-1.final"


def test_truncate_marks_cuts():
    assert truncate("a\nb", 2, 100) == ("a\nb", False)
    assert truncate("a\nb\nc", 2, 100) == ("a\nb", True)
    assert truncate("é" * 10, 10, 5) == ("éé", True)


@given(st.text(max_size=3000), st.integers(1, 300), st.integers(1, 5000))
def test_truncate_bounds(text, max_lines, max_bytes):
    out, cut = truncate(text, max_lines, max_bytes)
    assert len(out.encode("utf-8")) <= max_bytes
    assert len(out.split("\n")) <= max_lines
    assert text.startswith(out)
    assert cut == (out != text)
