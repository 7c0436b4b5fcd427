"""Seconds per unit of work (a block, a token), as measured: decayed means that follow the
machine as its load changes."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DecayedRate"]


@dataclass
class DecayedRate:
    """Seconds per unit over the work measured so far, each measurement's weight shrinking by
    ``decay`` with every later one. ``rate`` is None until something was measured."""

    decay: float = 0.9
    seconds: float = 0.0
    units: float = 0.0

    def add(self, seconds: float, units: float) -> None:
        self.seconds = self.decay * self.seconds + seconds
        self.units = self.decay * self.units + units

    @property
    def rate(self) -> float | None:
        return self.seconds / self.units if self.units > 0 else None
