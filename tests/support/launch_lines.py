"""The ``torchrun`` line of a launch script or manifest, as words (for tests that run it locally)."""

from __future__ import annotations

import shlex


def torchrun_words(text: str) -> list[str]:
    """The words of the first ``torchrun`` command in ``text`` (line continuations joined, comments
    skipped), from ``torchrun`` on."""
    joined = text.replace("\\\n", " ")
    line = next(line for line in joined.splitlines() if "torchrun " in line and not line.lstrip().startswith("#"))
    return shlex.split(line[line.index("torchrun ") :])
