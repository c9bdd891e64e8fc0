"""Speculation counters: per request (:class:`SpecMetrics`, on ``RequestOutput.metrics.spec``) and
for the engine (:meth:`SpeculativeDecoder.stats`)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecMetrics:
    proposer: str = ""
    steps: int = 0  # verify steps that carried at least one proposal
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0  # tokens the verify steps produced (accepted + the target's own)
    proposed_at: list[int] = field(default_factory=list)  # proposals at draft position i
    accepted_at: list[int] = field(default_factory=list)  # of them, accepted
    draft_s: float = 0.0  # time of the proposer calls this request took part in
    verify_s: float = 0.0  # time of the verify forwards it took part in
    recomputes: int = 0  # verify steps recomputed after non-finite logits
    num_tokens: int = 0  # the length the request proposes now (adaptive)

    def record(self, proposed: int, accepted: int, emitted: int) -> None:
        self.steps += 1
        self.drafted += proposed
        self.accepted += accepted
        self.emitted += emitted
        while len(self.proposed_at) < proposed:
            self.proposed_at.append(0)
            self.accepted_at.append(0)
        for i in range(proposed):
            self.proposed_at[i] += 1
            self.accepted_at[i] += i < accepted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verify step (accepted proposals + the target's own token); 1.0 = no gain."""
        return self.emitted / self.steps if self.steps else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / p if p else 0.0 for a, p in zip(self.accepted_at, self.proposed_at)]

    def as_dict(self) -> dict:
        return {"proposer": self.proposer, "steps": self.steps, "drafted": self.drafted, "accepted": self.accepted,
                "acceptance_rate": self.acceptance_rate, "mean_acceptance_length": self.mean_acceptance_length,
                "per_position_acceptance": self.per_position_acceptance, "draft_ms": self.draft_s * 1e3,
                "verify_ms": self.verify_s * 1e3, "recomputes": self.recomputes}

    def add(self, other: "SpecMetrics") -> None:
        self.steps += other.steps
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.emitted += other.emitted
        while len(self.proposed_at) < len(other.proposed_at):
            self.proposed_at.append(0)
            self.accepted_at.append(0)
        for i, (p, a) in enumerate(zip(other.proposed_at, other.accepted_at)):
            self.proposed_at[i] += p
            self.accepted_at[i] += a
        self.draft_s += other.draft_s
        self.verify_s += other.verify_s
        self.recomputes += other.recomputes
