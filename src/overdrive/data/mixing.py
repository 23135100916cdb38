"""Several data sets mixed by weight (`data.sources`): which source each training sample comes from.

Each source is described by the keys of `data` (`source_configs` gives each its own run
config with `data.*` set from its entry), tokenized into its own cache entry by the same
code as a single source, and read as its own map-style dataset. `Mixture` is one dataset
over them: sample k of the run is a pure function of k and the seed, so a resumed run (which
skips to its sample position) continues the same sequence, at any world size.

Which source sample k comes from: the point x_k = frac(offset + k / golden ratio) (a Weyl
sequence, offset from the seed) falls into one source's share of [0, 1), the shares in the
order of `data.sources`, sized by weight. Any run of n consecutive samples then holds each
source's share to within a few samples (the three-distance theorem bounds the gaps), much
tighter than independent draws, whose spread grows as sqrt(n). The d-th draw of a source is
its sample perm_e[d mod size], perm_e a permutation seeded by (seed, source, epoch e = d // size):
each pass over a source is a new shuffle, as with a single source.

With `data.when_exhausted=stop` the mixture ends at the last global batch before any source
would start its second pass; the training loop stops there.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from overdrive.config.schema import SOURCE_DESCRIPTION, RunConfig
from overdrive.errors import Problem, UserError

_GOLDEN = (math.sqrt(5) - 1) / 2  # 1/phi: the slowest-converging continued fraction, the evenest spread
_CHUNK = 1 << 14  # samples per block of the per-source draw counts
ENDLESS = 1 << 40  # length of a repeating mixture: more samples than any run takes


@dataclass(frozen=True)
class SourcePart:
    name: str
    weight: float
    cfg: RunConfig  # the run config with `data.*` describing this source alone
    key: str  # the config key of the entry, for messages: data.sources.<i> (or data for a single source)


def source_configs(cfg: RunConfig) -> list[SourcePart]:
    """Each source as a run config of its own: `data.source` and the describing keys from its entry
    (unset ones keep the `data.*` value). Without `data.sources`, `data.source` alone."""
    d = cfg.data
    if not d.sources:
        return [SourcePart(d.source, 1.0, cfg, "data")]
    parts = []
    for i, entry in enumerate(d.sources):
        update: dict[str, Any] = {"source": entry.source, "sources": []}
        update.update({k: getattr(entry, k) for k in SOURCE_DESCRIPTION if getattr(entry, k) is not None})
        parts.append(SourcePart(entry.name, entry.weight, cfg.model_copy(update={"data": d.model_copy(update=update)}),
                                f"data.sources.{i}"))
    return parts


def for_source(error: UserError, part: SourcePart) -> UserError:
    """A single source's problem, named by its entry's key (data.split -> data.sources.1.split)."""
    if part.key == "data":
        return error
    renamed = []
    for p in error.problems:
        field = p.key.removeprefix("data.")
        key = f"{part.key}.{field}" if p.key.startswith("data.") and (field in SOURCE_DESCRIPTION or field == "source") else p.key
        renamed.append(Problem(key, f"{part.name}: {p.message}", p.where, p.fix))
    return UserError(renamed, title=getattr(error, "title", None))


def shares(weights: list[float]) -> np.ndarray:
    """Upper edges of each source's share of [0, 1)."""
    w = np.asarray(weights, dtype=np.float64)
    return np.cumsum(w / w.sum())


def seed_offset(seed: int) -> float:
    digest = hashlib.blake2b(f"mixture:{seed}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


def source_of(k: np.ndarray, edges: np.ndarray, offset: float) -> np.ndarray:
    """The source index of samples k (an array), a pure function of k, the weights and the seed."""
    x = np.mod(offset + k.astype(np.float64) * _GOLDEN, 1.0)
    return np.minimum(np.searchsorted(edges, x, side="right"), len(edges) - 1)


class DrawCounts:
    """How many samples each source gave before sample k: block totals computed once, in order."""

    def __init__(self, edges: np.ndarray, offset: float):
        self.edges, self.offset = edges, offset
        self.before: list[np.ndarray] = [np.zeros(len(edges), dtype=np.int64)]  # counts before block b

    def _labels(self, block: int) -> np.ndarray:
        k: np.ndarray = np.arange(block * _CHUNK, (block + 1) * _CHUNK, dtype=np.int64)
        return source_of(k, self.edges, self.offset)

    def at(self, k: int) -> np.ndarray:
        block = k // _CHUNK
        while len(self.before) <= block:
            b = len(self.before) - 1
            self.before.append(self.before[b] + np.bincount(self._labels(b), minlength=len(self.edges)))
        within = self._labels(block)[:k - block * _CHUNK]
        return self.before[block] + np.bincount(within, minlength=len(self.edges))


class Mixture(torch.utils.data.Dataset):
    """Sample k of the run from the source the mixture schedule gives it (see the module doc).

    `ordered`: the loader must read it in index order (the order is the mixture's own)."""

    ordered = True

    def __init__(self, parts: list, names: list[str], weights: list[float], seed: int, shuffle: bool = True,
                 when_exhausted: str = "repeat"):
        self.parts, self.names, self.weights = parts, names, list(weights)
        self.seed, self.shuffle, self.when_exhausted = seed, shuffle, when_exhausted
        self.edges, self.offset = shares(weights), seed_offset(seed)
        self.sizes = [len(p) for p in parts]
        empty = [n for n, size, w in zip(names, self.sizes, weights) if size == 0 and w > 0]
        if empty:
            raise UserError(Problem("data.sources", f"source {empty[0]!r} gave no training samples",
                                    fix="give it more text, lower data.max_length, or set its weight to 0"))
        self._counts = DrawCounts(self.edges, self.offset)
        self._perms: dict[tuple[int, int], np.ndarray] = {}
        self.length = ENDLESS if when_exhausted == "repeat" else self._until_exhausted()

    def _until_exhausted(self) -> int:
        """Samples before the first source would begin a second pass (the counts only grow with k)."""
        fits = lambda k: bool(np.all(self._counts.at(k) <= self.sizes))  # noqa: E731
        low, high = 0, 1
        while fits(high):
            low, high = high, high * 2
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if fits(middle) else (low, middle)
        return low

    def __len__(self) -> int:
        return self.length

    def locate(self, k: int) -> tuple[int, int]:
        """(source index, sample index within it) of mixture sample k."""
        source = int(source_of(np.array([k]), self.edges, self.offset)[0])
        draw = int(self._counts.at(k)[source])
        size = self.sizes[source]
        epoch, position = divmod(draw, size)
        if not self.shuffle:
            return source, position
        perm = self._perms.get((source, epoch))
        if perm is None:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + source * 7919 + epoch)
            perm = torch.randperm(size, generator=generator).numpy()
            self._perms = {key: value for key, value in self._perms.items() if key[0] != source}
            self._perms[(source, epoch)] = perm
        return source, int(perm[position])

    def __getitem__(self, k: int):
        if not 0 <= k < self.length:
            raise IndexError(f"sample {k} of {self.length}")
        source, index = self.locate(k)
        return self.parts[source][index]

    def drawn(self, samples: int) -> dict[str, int]:
        """Samples drawn from each source in the first `samples` of the run."""
        return dict(zip(self.names, (int(c) for c in self._counts.at(samples))))

    def positions(self, samples: int) -> dict[str, dict[str, int]]:
        """Where each source is after `samples` (for the checkpoint): draws, pass, and place in the pass."""
        out = {}
        for name, count, size in zip(self.names, self._counts.at(samples), self.sizes):
            out[name] = {"drawn": int(count), "epoch": int(count) // size if size else 0,
                         "in_epoch": int(count) % size if size else 0}
        return out


class SourceTokens:
    """Tokens drawn so far from each source (metrics.jsonl `source_tokens`), counted from the schedule.

    Packed blocks hold `seq_len` tokens each; a classification row its own length (unpadded).
    Counted forward from the last call, so a run that logs every N steps pays for N steps."""

    def __init__(self, mixture: Mixture, seq_len: int):
        self.mixture, self.seq_len = mixture, seq_len
        self.samples, self.tokens = 0, {name: 0 for name in mixture.names}

    def _length(self, part, index: int) -> int:
        ends = getattr(part, "ends", None)
        if ends is None:
            return self.seq_len
        return int(ends[index]) - (int(ends[index - 1]) if index else 0)

    def at(self, samples: int) -> dict[str, int]:
        if samples < self.samples:
            self.samples, self.tokens = 0, {name: 0 for name in self.mixture.names}
        m = self.mixture
        if all(getattr(p, "ends", None) is None for p in m.parts):  # packed blocks: counts suffice
            return {name: count * self.seq_len for name, count in m.drawn(samples).items()}
        for k in range(self.samples, samples):
            source, index = m.locate(k)
            self.tokens[m.names[source]] += self._length(m.parts[source], index)
        self.samples = samples
        return dict(self.tokens)


def find_mixture(dataset) -> Optional[Mixture]:
    """The Mixture under a (prepared) DataLoader's dataset, if it is one."""
    for _ in range(3):
        if isinstance(dataset, Mixture):
            return dataset
        dataset = getattr(dataset, "dataset", None)
    return None
