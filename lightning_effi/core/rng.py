"""Deterministic seeds shared by the techniques: a 64-bit integer hash of ``(seed, purpose, ...)`` keys.

Every technique draws from a private ``torch.Generator`` seeded with :func:`hash64` of the user's seed, a per-technique
purpose constant and the coordinates of the draw (epoch, step, micro-batch, rank), so draws are reproducible in any
process and never touch the global RNGs.
"""

from __future__ import annotations

__all__ = ["hash64"]

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """One SplitMix64 step (Steele, Lea, Flood 2014): a bijective 64-bit mix with good avalanche."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def hash64(*keys: int) -> int:
    """Deterministic 64-bit hash of a sequence of integers, in ``[0, 2**64)``.

    ``h = 0; for k in keys: h = splitmix64(h XOR (k mod 2**64))``. Pure integer arithmetic: identical in every
    process, platform and Python version (unlike ``hash()``, which is salted per process). Negative keys are taken
    modulo 2**64 (two's complement).

    Raises:
        TypeError: a key is not an ``int`` (``bool`` is rejected).
    """
    h = 0
    for k in keys:
        if isinstance(k, bool) or not isinstance(k, int):
            raise TypeError(f"hash64 keys must be ints, got {k!r}")
        h = _splitmix64(h ^ (k & _MASK64))
    return h
