"""The search: successive halving run as a race, one stage after another; or the full grid.

Successive halving (Jamieson & Talwalkar 2016; the asynchronous form, ASHA, Li et al. 2020)
measures every candidate briefly and spends longer measurements only on the best. Here each
candidate is one trial process and its measurement grows in rungs (trials.Rung). Trials run
one at a time, because they would otherwise slow each other down; so the halving is applied
as a race: when a trial reaches a rung, it goes on only while it ranks in the top 1/eta of
every candidate that reached that rung so far (within `slack`, so that noise alone does not
end a near-tie). A slow candidate is stopped after a few steps; a fast one runs to the end.

The stages (space.STAGES) search the host settings first, then the compute layout on their
finalists, then torch.compile on theirs. The score is tokens/s over the whole configured run
(`training.max_steps`), with each candidate's one-off warm-up overhead (compilation above
all) paid once: a compiled model must be fast enough to earn its compile time back.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Optional

from overdrive.tune.space import STAGES, Candidate, Space, prune
from overdrive.tune.trials import Decide, Outcome, TrialPlan

Runner = Callable[[Candidate, Optional[Decide]], Outcome]


@dataclass(frozen=True)
class SearchSettings:
    mode: str = "staged"  # "staged" (successive halving per stage) or "grid" (everything, full length)
    eta: int = 3
    finalists: int = 2  # at most; the second only when within `carry` of the best
    carry: float = 0.15
    slack: float = 0.03
    budget_s: Optional[float] = None
    run_steps: int = 300

    def describe(self) -> dict:
        return {"mode": self.mode, "eta": self.eta, "finalists": self.finalists, "carry": self.carry, "slack": self.slack,
                "budget_s": self.budget_s, "run_steps": self.run_steps}


class Search:
    def __init__(self, space: Space, settings: SearchSettings, plan: TrialPlan, run: Runner,
                 fits: Callable[[Candidate], tuple[bool, int]], log: Callable[[str], None] = lambda _: None,
                 clock: Callable[[], float] = time.monotonic):
        self.space, self.settings, self.plan, self.run_trial = space, settings, plan, run
        self.fits, self.log, self.clock = fits, log, clock
        self.seen: dict[tuple[str, ...], Candidate] = {}
        self.started = clock()
        self.trials = 0

    def score(self, c: Candidate, upto: Optional[int] = None) -> float:
        return c.measurement.run_tokens_per_s(self.settings.run_steps, upto) if c.measurement else 0.0

    def ok(self) -> list[Candidate]:
        return sorted((c for c in self.seen.values() if c.status == "ok"), key=lambda c: -self.score(c))

    def finalists(self) -> list[Candidate]:
        """The best, and the runners-up close enough to it that an interaction with the next
        stage's settings could still reverse the order (within `carry`)."""
        ranked = self.ok()
        if not ranked:
            return []
        best = self.score(ranked[0])
        return [c for c in ranked[: self.settings.finalists] if self.score(c) >= best * (1 - self.settings.carry)]

    def elapsed(self) -> float:
        return self.clock() - self.started

    # ------------------------------------------------------------------ driver

    def execute(self) -> list[Candidate]:
        """Every candidate considered, with its status and measurement."""
        if self.settings.mode == "grid":
            candidates = self._admit(self.space.grid(), dominance=False)
            self._race("grid", candidates, [], halving=False)
        else:
            every = self.space.grid()
            fitting = sum(1 for c in every if self.fits(c)[0])
            self.log(f"memory estimate: {fitting} of {len(every)} combinations fit")
            finalists = [self.space.baseline]
            for stage, dims in STAGES:
                pool = [v for f in finalists for v in self.space.variations(f, dims)]
                fresh = self._admit(pool, dominance=True)
                seeds = [c for c in finalists if c.status == "ok"]
                self._race(stage, fresh, seeds, halving=True)
                finalists = self.finalists() or finalists
        return list(self.seen.values())

    def _admit(self, pool: list[Candidate], dominance: bool) -> list[Candidate]:
        """New candidates of `pool` (known ones are not measured twice), pruned by memory."""
        fresh = []
        for c in pool:
            if c.key not in self.seen:
                self.seen[c.key] = c
                fresh.append(c)
        kept = prune(fresh, self.fits, self.space)
        if not dominance:  # the grid measures dominated candidates too: it checks the rule
            for c in fresh:
                if c.status == "dominated":
                    c.status, c.reason = "pending", ""
            kept = [c for c in fresh if c.status == "pending"]
        return kept

    # ------------------------------------------------------------------ one race

    def _race(self, stage: str, candidates: list[Candidate], seeds: list[Candidate], halving: bool) -> None:
        rungs: list[dict[tuple[str, ...], float]] = [{} for _ in self.plan.rungs[:-1]]
        for s in seeds:  # finalists of the stage before compete at every rung
            for k, steps in enumerate(s.measurement.rung_steps[: len(rungs)]):
                rungs[k][s.key] = self.score(s, steps)
        for index, c in enumerate(candidates, 1):
            c.stage = stage
            budget = self.settings.budget_s
            if budget is not None and self.elapsed() >= budget and self.trials > 0:
                c.status, c.reason = "skipped", f"budget of {budget / 60:g} min used up"
                continue
            self.trials += 1
            outcome = self.run_trial(c, self._decider(c, rungs) if halving else None)
            c.status, c.reason, c.measurement, c.trial_s = outcome.status, outcome.reason, outcome.measurement, outcome.seconds
            c.log_tail = outcome.log_tail
            speed = f"{self.score(c):,.0f} tokens/s" if c.measurement and c.measurement.step_s else ""
            self.log(f"{stage} {index}/{len(candidates)}  {c.label}  {c.status}  {speed}  {c.reason}".rstrip())

    def _decider(self, c: Candidate, rungs: list[dict[tuple[str, ...], float]]) -> Decide:
        eta, slack, run_steps = self.settings.eta, self.settings.slack, self.settings.run_steps

        def decide(rung: int, m) -> Optional[str]:
            score = m.run_tokens_per_s(run_steps)
            scores = rungs[rung]
            scores[c.key] = score
            quota = math.ceil(len(scores) / eta)
            cut = sorted(scores.values(), reverse=True)[quota - 1]
            if score >= cut * (1 - slack):
                return None
            return (f"stopped at rung {rung + 1} ({len(m.step_s)} steps): {score:,.0f} tokens/s, "
                    f"not in the top {quota} of {len(scores)} (>= {cut:,.0f})")

        return decide
