"""Engram's hash constants: the published multipliers and primes of DeepSeek V4.1-Flash."""

from __future__ import annotations

from b12x_toolchain.exporter.model.engram_hashing import layer_multipliers, layer_primes, primes_from

COMPRESSED_VOCAB = 99092
PRIME_START = 16_000_000  # the config's engram_vocab_size
LAYERS = [1, 14]


def _is_prime(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, int(n**0.5) + 1))


def test_multipliers_are_the_published_ones():
    assert layer_multipliers(1, 4, COMPRESSED_VOCAB) == [76632096046245, 4839876093313, 35959672319349, 73987337458391]
    assert layer_multipliers(14, 4, COMPRESSED_VOCAB) == [67716810739261, 51510806800915, 30921347202721,
                                                          82619226485591]


def test_multipliers_keep_products_and_their_xor_non_negative():
    for layer in LAYERS:
        for m in layer_multipliers(layer, 4, COMPRESSED_VOCAB):
            assert m % 2 == 1 and COMPRESSED_VOCAB * m < 1 << 63


def test_layer_primes_are_the_published_ones_and_sum_to_the_table_rows():
    primes = layer_primes(PRIME_START, LAYERS, 3, 8)
    first, second = primes[1], primes[14]
    assert len(first) == len(second) == 24
    assert first[:4] == [16000057, 16000079, 16000081, 16000097] and first[-1] == 16000463
    assert second[0] == 16000477 and second[-1] == 16000889
    assert (sum(first), sum(second)) == (384006168, 384016682)  # the config's engram_num_embeddings
    everything = first + second
    assert everything == sorted(set(everything)) and all(_is_prime(p) for p in everything)


def test_primes_from_is_every_prime_in_order():
    assert primes_from(0, 6) == [2, 3, 5, 7, 11, 13]
    assert primes_from(14, 3) == [17, 19, 23]
    assert primes_from(17, 1) == [17] and primes_from(5, 0) == []
    got = primes_from(1000, 50)
    assert got == [n for n in range(1000, got[-1] + 1) if _is_prime(n)]
