"""Record one keyword argument of every call of a module-level function (a test spy)."""

from __future__ import annotations

from typing import Any

import pytest


def record_kwarg(monkeypatch: pytest.MonkeyPatch, owner: object, name: str, kwarg: str
                 ) -> list[Any]:
    """Replace ``owner.name`` by a wrapper that appends each call's ``kwarg`` (None if absent).

    Returns:
        The list the calls append to (the wrapper calls the real function).
    """
    calls: list[Any] = []
    real = getattr(owner, name)

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs.get(kwarg))
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, spy)
    return calls
