"""A run's certified loss curve: eval loss over versions and tokens, from its verified chain.

Each certificate of a run with a held-out split carries the eval loss its committee measured
on the state it certifies (ADR 0059); its receipts say how many tokens that version merged.
Fed the verified chain in order (``core.ledger.ChainFollower``), the curve holds one point per
evaluated version: a claim nobody certified never enters it. Memory is bounded for a run of
any length: it keeps every ``stride``-th evaluated version, and past ``max_points`` drops every
other one and doubles the stride, so the points stay evenly spread over the whole run; the
newest version is always shown. Pure: no IO, no torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from p2pdiloco.protocol.certificates import Certificate, CertificateBody

MAX_POINTS = 512


@dataclass(frozen=True)
class CurvePoint:
    version: int
    tokens: int  # tokens merged by the chain up to and including this version
    eval_loss: float

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "tokens": self.tokens, "eval_loss": self.eval_loss}


@dataclass
class LossCurve:
    max_points: int = MAX_POINTS
    version: int = 0  # the newest version added
    tokens: int = 0  # tokens of every version added
    kept: list[CurvePoint] = field(default_factory=list)  # evaluated versions 0, s, 2s, …
    latest: CurvePoint | None = None  # the newest evaluated version, when not in ``kept``
    stride: int = 1
    evaluated: int = 0  # versions with an eval loss added

    def add(self, body: CertificateBody) -> None:
        """The next verified version (bodies must come in chain order, each once)."""
        self.version = body.version
        self.tokens += sum(a.tokens for a in body.accepted)
        if body.eval_loss is None:
            return
        point = CurvePoint(body.version, self.tokens, body.eval_loss)
        self.evaluated += 1
        if (self.evaluated - 1) % self.stride:
            self.latest = point
            return
        self.kept.append(point)
        self.latest = None
        if len(self.kept) >= self.max_points:
            self.kept = self.kept[::2]
            self.stride *= 2

    @property
    def points(self) -> list[CurvePoint]:
        """The points shown, oldest first: at most ``max_points``, the newest always."""
        return self.kept + ([self.latest] if self.latest is not None else [])

    def to_list(self) -> list[dict[str, Any]]:
        return [p.to_dict() for p in self.points]


def loss_curve(chain: Iterable[Certificate], max_points: int = MAX_POINTS) -> LossCurve:
    """The curve of a verified chain from genesis (``ledger.verified_chain``)."""
    curve = LossCurve(max_points)
    for cert in chain:
        curve.add(cert.body)
    return curve
