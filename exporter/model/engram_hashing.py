"""The constants of DeepSeek V4.1's Engram n-gram hashing, derived as the reference derives them.

An Engram layer hashes each token's last n-gram (orders 2..n, H heads per order) into
rows of one big embedding table. The checkpoint stores only the table; the exporter has
to rebuild the hash's constants, and they must be the reference's exactly, or every
lookup reads the wrong row:

* Primes: each (layer, order, head) column takes its own prime modulus, the consecutive
  primes from the config's `engram_vocab_size` (a search start, not a row count), never
  reused, in order layer -> order -> head. A layer's table rows are the sum of its primes
  (the config's `engram_num_embeddings`), each column owning the rows from the exclusive
  prefix sum of the primes before it.
* Multipliers: one odd random int64 per n-gram slot and layer, drawn from numpy's PCG64
  seeded by the layer id, below a bound that keeps every product of a compressed id and a
  multiplier, and their XOR, non-negative in int64.
"""

from __future__ import annotations

from math import isqrt

import numpy

INT64_MAX = (1 << 63) - 1
MULTIPLIER_SEED = 10007  # the reference seeds layer L's generator with 10007 * L


def _small_primes(limit: int) -> list[int]:
    """Primes <= limit (a sieve of Eratosthenes): the trial divisors for `primes_from`."""
    sieve = bytearray([1]) * (limit + 1)
    sieve[: min(2, limit + 1)] = b"\x00" * min(2, limit + 1)
    for p in range(2, isqrt(limit) + 1):
        if sieve[p]:
            sieve[p * p :: p] = bytes(len(range(p * p, limit + 1, p)))
    return [p for p in range(limit + 1) if sieve[p]]


def primes_from(start: int, count: int) -> list[int]:
    """The first `count` primes >= start, by trial division.

    Prime gaps near 1.6e7 average about 17, so the tables' 48 primes take under a thousand
    candidates, each divided by the ~550 primes up to its square root: milliseconds.
    """
    if count < 0:
        raise ValueError(f"count must be >= 0, not {count}")
    found: list[int] = []
    candidate = max(start, 2)
    divisors = _small_primes(isqrt(candidate) + 1)
    while len(found) < count:
        if isqrt(candidate) > divisors[-1]:  # grown past the sieve: sieve twice as far
            divisors = _small_primes(2 * isqrt(candidate) + 1)
        root = isqrt(candidate)
        if all(candidate % p for p in divisors if p <= root):
            found.append(candidate)
        candidate += 1
    return found


def layer_primes(start: int, layer_ids: list[int], orders: int, heads: int) -> dict[int, list[int]]:
    """Each layer's `orders * heads` prime moduli: consecutive primes >= start, none reused.

    They are assigned layer by layer (in the order of `layer_ids`), order by order (2..n),
    head by head, so column c = (order - 2) * heads + h of a layer takes its list's item c.
    """
    per_layer = orders * heads
    primes = primes_from(start, per_layer * len(layer_ids))
    return {layer: primes[i * per_layer : (i + 1) * per_layer] for i, layer in enumerate(layer_ids)}


def layer_multipliers(layer_id: int, max_ngram: int, compressed_vocab: int) -> list[int]:
    """The `max_ngram` odd hash multipliers of layer `layer_id`; item k multiplies the token k back.

    The bound is half of INT64_MAX // compressed_vocab, so m = 2v + 1 is at most
    INT64_MAX // compressed_vocab and a compressed id times it fits in int64; an XOR of
    non-negative int64s is non-negative, so the hash never overflows and its modulus never
    sees a negative number.
    """
    bound = (INT64_MAX // compressed_vocab) // 2
    rng = numpy.random.default_rng(MULTIPLIER_SEED * layer_id)
    draws = rng.integers(0, bound, size=max_ngram, dtype=numpy.int64)
    return [2 * int(v) + 1 for v in draws]
