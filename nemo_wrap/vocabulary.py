"""Closed vocabularies as enums whose members are the very strings users write.

A precision (``"bf16-mixed"``), a pipeline schedule (``"1f1b"``), a mesh dimension (``"tp"``) is one
of a fixed few words. Code names them by member, so a typo fails at import and every choice is
listed in one place; but users, YAML recipes and torch (which indexes a ``DeviceMesh`` by name) keep
writing and reading plain strings. A :class:`Vocabulary` member is a ``str`` that compares, hashes,
prints and formats as its word (the ``enum.StrEnum`` of Python 3.11, which 3.10 lacks).
"""

from __future__ import annotations

import enum
from typing import TypeVar

from nemo_wrap.errors import InvalidSetupError

_Word = TypeVar("_Word", bound="Vocabulary")


class Vocabulary(str, enum.Enum):
    """Base of the closed vocabularies: members behave as their string values."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, format_spec: str) -> str:
        return format(str(self.value), format_spec)

    @classmethod
    def words(cls) -> tuple[str, ...]:
        """Every word of the vocabulary, in declaration order (for messages and CLI choices)."""
        return tuple(member.value for member in cls)

    @classmethod
    def parse(cls: type[_Word], value: object, argument: str, error: type[Exception] = InvalidSetupError) -> _Word:
        """The member ``value`` names (a member passes as itself); ``error`` naming ``argument`` and
        every word otherwise."""
        for member in cls:
            if value == member.value:
                return member
        raise error(f"{argument}={value!r}: choose one of {list(cls.words())}")
