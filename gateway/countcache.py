"""The token counter's cache: text digest -> token count, least recently used first out.

A chat's system prompt and earlier turns come back with every request of a conversation; their
counts are looked up by digest instead of encoded again (gateway.estimator.TokenCounter).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence


class CountCache:
    """Bounded map digest -> token count. Entries are fixed-size (16-byte key, small int, ~0.2 KB
    with the dict's overhead), so a bound on entries is a bound on bytes."""

    def __init__(self, max_entries: int) -> None:
        self._data: OrderedDict[bytes, int] = OrderedDict()
        self._max = max_entries
        self._lock = threading.Lock()

    def get(self, key: bytes) -> int | None:
        with self._lock:
            value = self._data.get(key)
            if value is not None:
                self._data.move_to_end(key)
            return value

    def put_many(self, items: Sequence[tuple[bytes, int]]) -> None:
        if self._max <= 0:
            return
        with self._lock:
            for key, value in items:
                self._data[key] = value
                self._data.move_to_end(key)
            while len(self._data) > self._max:
                self._data.popitem(last=False)

    def __len__(self) -> int:
        return len(self._data)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
