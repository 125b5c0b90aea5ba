"""The one page-token loop: pages fetched in order, a store that repeats, inflates or never ends its
tokens ends the listing with the caller's error, after the pages before it were used."""

from __future__ import annotations

import pytest

from unshardfs.util.paging import MAX_PAGE_TOKEN, PageTokens


class Refused(Exception):
    pass


def listing(pages: dict[str | None, str | None], limit: int = 100) -> tuple[list[str | None], Exception | None]:
    """Follow `pages` (token -> the next page's token): the tokens asked for, and the error if any."""
    asked: list[str | None] = []
    tokens = PageTokens(limit, Refused)
    try:
        for token in tokens:
            asked.append(token)
            tokens.follow(pages[token])
    except Refused as e:
        return asked, e
    return asked, None


def test_the_tokens_are_followed_until_a_page_names_none() -> None:
    assert listing({None: "a", "a": "b", "b": None}) == ([None, "a", "b"], None)
    assert listing({None: "a", "a": ""}) == ([None, "a"], None)
    assert listing({None: None}) == ([None], None)


def test_a_page_not_followed_is_the_last() -> None:
    tokens = PageTokens(10, Refused)
    assert list(tokens) == [None]


def test_a_repeated_token_ends_the_listing() -> None:
    asked, error = listing({None: "a", "a": "b", "b": "a"})
    assert asked == [None, "a", "b"] and str(error) == "server repeated page token"


def test_an_oversized_token_ends_the_listing() -> None:
    asked, error = listing({None: "x" * (MAX_PAGE_TOKEN + 1)})
    assert asked == [None] and str(error) == f"server sent a page token of {MAX_PAGE_TOKEN + 1} characters"
    assert listing({None: "x" * MAX_PAGE_TOKEN, "x" * MAX_PAGE_TOKEN: None})[1] is None


def test_endless_tokens_end_after_the_most_pages() -> None:
    class Endless(dict[str | None, str | None]):
        def __missing__(self, token: str | None) -> str:
            return f"{token}+"

    asked, error = listing(Endless({None: "0"}), limit=20)
    assert len(asked) == 20 and str(error) == "more than 20 pages"
