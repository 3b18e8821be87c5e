"""Where each parameter's values came from, and the report that proves the load.

Every parameter and persistent buffer gets exactly one provenance: read from a checkpoint file
(which key, through which adapter transform), tied to another parameter, initialized (by which
rule, and why that was allowed), or missing. ``LoadReport`` holds them with the plan; ``strict``
loading raises :class:`MissingWeightsError` when anything is missing.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import ClassVar

from nemo_wrap.errors import summarize
from nemo_wrap.loading.plan import LoadPlan
from nemo_wrap.vocabulary import Vocabulary


class ProvenanceKind(Vocabulary):
    """The four things a tensor's values can be, one per provenance class (its ``kind``)."""

    CHECKPOINT = "checkpoint"
    TIED = "tied"
    INITIALIZED = "initialized"
    MISSING = "missing"


@dataclass(frozen=True)
class Loaded:
    files: tuple[str, ...]
    keys: tuple[str, ...]
    transform: str  # "identity", or the adapter's fusion

    kind: ClassVar[ProvenanceKind] = ProvenanceKind.CHECKPOINT

    def describe(self) -> str:
        via = "" if self.transform == "identity" else f" ({self.transform})"
        return f"{', '.join(self.keys)} in {', '.join(self.files)}{via}"


@dataclass(frozen=True)
class Tied:
    source: str

    kind: ClassVar[ProvenanceKind] = ProvenanceKind.TIED

    def describe(self) -> str:
        return f"tied to {self.source}"


@dataclass(frozen=True)
class Initialized:
    rule: str
    reason: str

    kind: ClassVar[ProvenanceKind] = ProvenanceKind.INITIALIZED

    def describe(self) -> str:
        return f"{self.rule}: {self.reason}"


@dataclass(frozen=True)
class Missing:
    expected_keys: tuple[str, ...]

    kind: ClassVar[ProvenanceKind] = ProvenanceKind.MISSING

    def describe(self) -> str:
        return f"not in the checkpoint (looked for {', '.join(self.expected_keys)})"


Provenance = Loaded | Tied | Initialized | Missing


@dataclass
class LoadReport:
    """The audit of one load: the plan, one provenance per tensor, what was read, what was checked."""

    plan: LoadPlan
    provenance: dict[str, Provenance]
    unexpected_keys: tuple[str, ...] = ()
    bytes_read: int = 0
    verified: bool | None = None  # None: verify=False

    def counts(self) -> dict[ProvenanceKind, int]:
        counted = Counter(p.kind for p in self.provenance.values())
        return {kind: counted.get(kind, 0) for kind in ProvenanceKind}

    def names(self, kind: ProvenanceKind) -> list[str]:
        return [name for name, p in self.provenance.items() if p.kind == kind]

    def rows(self) -> list[tuple[str, str, str]]:
        """(name, kind, detail) per tensor: what a notebook renders as a table."""
        return [(name, p.kind, p.describe()) for name, p in self.provenance.items()]

    def summary(self) -> str:
        counts = self.counts()
        parts = [f"{n} {kind}" for kind, n in counts.items() if n]
        lines = [
            f"load report: {len(self.provenance)} tensors — {', '.join(parts)}; "
            f"{self.bytes_read:,} bytes read on this rank"
        ]
        if self.unexpected_keys:
            lines.append(f"  unused checkpoint keys: {summarize(self.unexpected_keys)}")
        if self.verified is not None:
            lines.append(
                f"  verify: {'checksums of every tensor match the checkpoint' if self.verified else 'MISMATCH'}"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        body = [f"  {name:<52} {kind:<11} {detail}" for name, kind, detail in self.rows()]
        return "\n".join([str(self.plan), self.summary(), *body])
