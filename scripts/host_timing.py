"""Host time of a call, shared by the host probes (no imports with side effects: probe_plan_cpu sets
TRITON_INTERPRET at import, the GPU probes must not)."""
import time


def best_us(fn, warmup: int, calls: int, rounds: int = 7, sync=None) -> float:
    """Microseconds a call of fn: the best of `rounds` timings of `calls` calls, after `warmup` calls; `sync` (e.g.
    torch.cuda.synchronize) runs after the warm-up and after each round, outside the timing."""
    for _ in range(warmup):
        fn()
    if sync is not None:
        sync()
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls * 1e6)
        if sync is not None:
            sync()
    return best
