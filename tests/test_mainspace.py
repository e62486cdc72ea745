"""``nimbus._mainspace``: one namespace per sending ``__main__``, whatever the threads."""

from __future__ import annotations

import sys
import threading
import uuid
from collections import OrderedDict

import pytest

from nimbus import _mainspace


def test_two_threads_pickling_mains_functions_first_get_one_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Review 7 #13: two threads pickling functions of ``__main__`` for the first time at
    once each made a key for it: their functions got two namespaces in the worker (the
    initializer's globals ``NameError`` again). The second now finds the first's key.
    Both threads are held where a key is made, until both are there or 3 s passed."""
    monkeypatch.setattr(_mainspace, "_spaces", OrderedDict())
    monkeypatch.setattr(_mainspace, "_keys", {})
    both = threading.Barrier(2)

    class _HeldUuid:
        @staticmethod
        def uuid4() -> uuid.UUID:
            try:
                both.wait(timeout=3)  # (with the lock: the other waits for it, not here)
            except threading.BrokenBarrierError:
                pass
            return uuid.uuid4()

    monkeypatch.setattr(_mainspace, "uuid", _HeldUuid)
    main = vars(sys.modules["__main__"])
    keys: list[str | None] = []
    threads = [
        threading.Thread(target=lambda: keys.append(_mainspace._key_of(main))) for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(keys) == 2 and keys[0] is not None
    assert keys[0] == keys[1]
    assert list(_mainspace._spaces) == [keys[0]]
