"""``StrEnum`` on every Python lineside supports (3.11 has it; JetPack 6's Python is 3.10).

Members are ``str``: they compare equal to, hash like, format and JSON-encode as their value, so a
typed status or kind leaves manifests, HTTP bodies and metric labels byte-identical.
"""

from __future__ import annotations

import sys

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # pragma: no cover - exercised on Python 3.10 only
    from enum import Enum

    class StrEnum(str, Enum):
        """Python 3.11's ``enum.StrEnum``: ``str()`` and ``format()`` give the value, not ``Cls.NAME``."""

        def __str__(self) -> str:
            return str.__str__(self)

__all__ = ["StrEnum"]
