"""Chain speculative sampling: one Triton program per request.

The random numbers come from the host (int64 values in [0, 2^31), `n + 1` per request: one acceptance
uniform per draft position, then one for the final token), so that this kernel and the torch path in
`serveattn/sampling.py` consume the same numbers and return the same tokens, bitwise. The final token is
drawn by inverse CDF over integer weights (probabilities in 2^-32 fixed point), so its prefix sums are
exact and do not depend on the summation order of either implementation.
"""
import triton
import triton.language as tl

TWO_POW_32: tl.constexpr = tl.constexpr(4294967296.0)
TWO_POW_M24: tl.constexpr = tl.constexpr(5.960464477539063e-08)  # 2^-24: u = top 24 bits, exact in float32, < 1


@triton.jit
def _final_weights(target, draft, k, V, offs, has_q, TWO_POW_32: tl.constexpr):
    """Integer weights (units of 2^-32) of the residual max(0, p - q) and of p at position k, vocab offs."""
    m = offs < V
    p = tl.load(target + k * V + offs, mask=m, other=0.0)
    q = tl.load(draft + k * V + offs, mask=m & has_q, other=0.0)
    r = tl.minimum(tl.maximum(p - q, 0.0), 1.0)
    return (r * TWO_POW_32).to(tl.int64), (tl.minimum(tl.maximum(p, 0.0), 1.0) * TWO_POW_32).to(tl.int64)


@triton.jit
def chain_speculative_sampling_kernel(draft_ptr, ids_ptr, target_ptr, rand_ptr, out_ptr, accepted_ptr,
                                      emitted_ptr, n, V, BLOCK_V: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    draft = draft_ptr + b * n * V
    target = target_ptr + b * (n + 1) * V
    rand = rand_ptr + b * (n + 1)
    out = out_ptr + b * (n + 1)

    accepted = tl.zeros((), dtype=tl.int32)
    emitted = tl.zeros((), dtype=tl.int32)
    running = tl.full((), 1, dtype=tl.int32)
    for i in range(0, n):
        tok = tl.load(ids_ptr + b * n + i).to(tl.int64)
        q = tl.load(draft + i * V + tok)
        p = tl.load(target + i * V + tok)
        u = (tl.load(rand + i) >> 7).to(tl.float32) * TWO_POW_M24
        ok = u * q < p
        accepted += ok.to(tl.int32)
        take = ok & (running != 0)
        tl.store(out + i, tok.to(tl.int32), mask=take)
        emitted += take.to(tl.int32)
        running = tl.where(take, running, 0)

    # The final token: from the residual max(0, p - q) at the first rejected position, or from the target
    # at position n when every draft token was accepted (a bonus token).
    k = emitted.to(tl.int64)
    has_q = k < n
    offs0 = tl.arange(0, BLOCK_V)
    total_r = tl.zeros((), dtype=tl.int64)
    total_p = tl.zeros((), dtype=tl.int64)
    for start in range(0, V, BLOCK_V):
        offs = start + offs0
        w_r, w_p = _final_weights(target, draft, k, V, offs, has_q, TWO_POW_32)
        total_r += tl.sum(w_r, axis=0)
        total_p += tl.sum(w_p, axis=0)
    use_r = total_r > 0
    total = tl.where(use_r, total_r, total_p)
    u31 = tl.load(rand + n)
    threshold = (total >> 31) * u31 + (((total & 0x7FFFFFFF) * u31) >> 31)  # floor(total * u31 / 2^31)

    count = tl.zeros((), dtype=tl.int64)
    carry = tl.zeros((), dtype=tl.int64)
    for start in range(0, V, BLOCK_V):
        offs = start + offs0
        m = offs < V
        w_r, w_p = _final_weights(target, draft, k, V, offs, has_q, TWO_POW_32)
        w = tl.where(use_r, w_r, w_p)
        cs = tl.cumsum(w, axis=0) + carry
        count += tl.sum(((cs <= threshold) & m).to(tl.int64), axis=0)
        carry += tl.sum(w, axis=0)
    token = tl.minimum(count, V - 1)
    tl.store(out + k, token.to(tl.int32))
    tl.store(accepted_ptr + b, accepted)
    tl.store(emitted_ptr + b, emitted)
