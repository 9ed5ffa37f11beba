"""Host-side launch arithmetic (block sizes, grids) in plain Python integers.

In Triton 3.6 `triton.next_power_of_2` and `triton.cdiv` are ConstexprFunction objects: 2-4 us of host time per
call, several per run(). These give the same values."""


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (0 for n <= 0, as triton.next_power_of_2)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for b > 0."""
    return -(-a // b)
