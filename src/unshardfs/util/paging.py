"""A listing read page by page: the one loop that follows page tokens, for every store we list.

Object stores answer a listing a page at a time, each page naming the token
of the next. A token is untrusted: a store (or anything between it and us)
can send the same one again (a listing that never ends), one of megabytes
(each request carrying it back), or tokens without end. `PageTokens` yields
the token of each page to ask for, and ends the listing with the caller's
error at the first repeated or oversized token, or past a number of pages.
It knows no I/O: the caller fetches a page inside the loop, synchronously or
on trio.
"""

from __future__ import annotations

from typing import Callable, Iterator

# Page tokens travel back in the next URL; real ones are a few hundred bytes.
MAX_PAGE_TOKEN = 4096


class PageTokens:
    """The tokens of one listing's pages::

        tokens = PageTokens(10_000, lambda why: SourceError(f"listing {where}: {why}"))
        for token in tokens:  # None first: the first page
            page = fetch(token)
            ...  # use the page
            tokens.follow(page.next_token)  # None or "": that was the last page

    `fail(why)` makes the error raised when the store repeats or inflates a
    token, or sends more than `pages` pages.
    """

    def __init__(self, pages: int, fail: Callable[[str], Exception], longest: int = MAX_PAGE_TOKEN) -> None:
        self.pages = pages
        self.fail = fail
        self.longest = longest
        self._next: str | None = None
        self._more = True
        self._seen: set[str] = set()

    def follow(self, token: str | None) -> None:
        """The token the page just fetched names for the next one (None or '': it was the last)."""
        if not token:
            self._more = False
            return
        if token in self._seen:
            raise self.fail("server repeated page token")
        if len(token) > self.longest:
            raise self.fail(f"server sent a page token of {len(token)} characters")
        self._seen.add(token)
        self._next = token
        self._more = True

    def __iter__(self) -> Iterator[str | None]:
        token: str | None = None
        for _ in range(self.pages):
            self._more = False
            yield token
            if not self._more:
                return
            token = self._next
        raise self.fail(f"more than {self.pages} pages")
