"""One sequence's prompt-lookup drafting record: how often its drafts were accepted, and whether it still drafts.

Apart from `speculative` (which proposes and verifies drafts) so that a sequence's state can hold it without the
scheduler importing the drafter.
"""

from __future__ import annotations

from dataclasses import dataclass

_EMA_WEIGHT = 0.3  # how much one verification moves a sequence's acceptance average
_PROBATION = 4  # verifications before a sequence may be switched off
_MIN_ACCEPTANCE = 0.5  # below this average a sequence stops drafting


@dataclass
class DraftState:
    """One sequence's drafting record; the scheduler records each verify's outcome (`update_from_output`)."""

    enabled: bool = True
    attempts: int = 0
    drafted: int = 0
    accepted: int = 0
    acceptance: float = 1.0  # moving average of accepted / drafted, optimistic until measured

    def record(self, drafted: int, accepted: int) -> None:
        self.attempts += 1
        self.drafted += drafted
        self.accepted += accepted
        self.acceptance += _EMA_WEIGHT * (accepted / drafted - self.acceptance)
        if self.attempts >= _PROBATION and self.acceptance < _MIN_ACCEPTANCE:
            self.enabled = False
