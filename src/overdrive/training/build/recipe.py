"""What the loop asks of the run's optimizer and data mixture, in one place.

- `Recipe.train_mode()` / `eval_mode()`: schedule-free optimizers keep two points and must be
  told which one the weights should hold: `eval` before evaluating and saving, `train` before
  the next step (schedulefree's docs). A no-op for every other optimizer.
- `Recipe.source_tokens(state)`: tokens drawn so far from each source (metrics.jsonl).
- `Recipe.positions(state)`: where each source of a mixture is (saved in the checkpoint; a
  resumed run's mixture is a function of its sample position, so this is a record, checked
  against the mixture on resume).
- `Recipe.exhausted(state)`: a mixture with `data.when_exhausted=stop` has run out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from overdrive.config import batch
from overdrive.data.mixing import Mixture, SourceTokens, find_mixture
from overdrive.training.build.optimizers import set_mode

if TYPE_CHECKING:
    from overdrive.config.schema import RunConfig


class Recipe:
    def __init__(self, cfg: RunConfig, optimizer: Any, train_loader: Any, seq_len: int):
        self.cfg, self.optimizer = cfg, optimizer
        self.mixture: Optional[Mixture] = find_mixture(getattr(train_loader, "dataset", None))
        self.tokens = SourceTokens(self.mixture, seq_len) if self.mixture is not None else None

    def train_mode(self) -> None:
        set_mode(self.optimizer, "train")

    def eval_mode(self) -> None:
        set_mode(self.optimizer, "eval")

    def _samples(self, state: Any) -> int:
        return state.step * batch.split(self.cfg).global_batch  # every step takes one global batch

    def source_tokens(self, state: Any) -> dict[str, int]:
        if self.tokens is None:
            return {self.cfg.data.source: state.tokens_seen}
        return self.tokens.at(self._samples(state))

    def positions(self, state: Any) -> Optional[dict[str, Any]]:
        return None if self.mixture is None else self.mixture.positions(self._samples(state))

    def check_resumed(self, state: Any) -> Optional[str]:
        """A note when the checkpoint's source positions are not where this mixture puts them."""
        saved = state.source_positions
        if self.mixture is None or saved is None:
            return None
        now = self.mixture.positions(self._samples(state))
        if saved != now:
            return (f"note: the data mixture differs from the checkpoint's ({saved} there, {now} now): "
                    "the sources or their weights changed")
        return None

    def exhausted(self, state: Any) -> Optional[str]:
        m = self.mixture
        if m is None or m.when_exhausted != "stop" or self._samples(state) < len(m):
            return None
        counts = m.drawn(len(m))
        first = next((n for n, size in zip(m.names, m.sizes) if counts[n] >= size), m.names[0])
        return f"data source {first!r} is exhausted (data.when_exhausted=stop)"
