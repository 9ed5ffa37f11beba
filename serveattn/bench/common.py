"""What every benchmark family shares: the CUDA check, timing, ceilings, floors, the runners (prepared calls, the
poisoned check, SDPA / FlexAttention / FlashInfer plumbing), the per-case prepare-check-time loop, tables, progress,
JSON. A family module keeps its shapes, inputs, our wrappers and its own tables.

Nothing here touches CUDA or imports Triton at import time, so ``python -m serveattn.bench --help``
works on a machine without a GPU.

Method (/work/.library/device/METHOD.md): times are medians of ``triton.testing.do_bench`` (CUDA events,
warm-up first, L2 flushed before every repetition); every runner is timed in ``passes`` separate passes
interleaved with the other runners, the reported time is the mean of the pass medians and the spread
between passes is printed as the noise level. Inputs are random (``torch.randn``), never zeros.
"""
from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import math
import os
import platform
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

# ---------------------------------------------------------------- ceilings (H200 defaults)

#: Device-to-device copy on the H200, bytes read + bytes written per second (baseline run 2026-12-02).
DEFAULT_BANDWIDTH = 4.27e12
#: Dense bf16 matrix product on the H200 (the baseline run saw 687-798 TFLOP/s; 690 is the floor we use).
DEFAULT_BF16_RATE = 690e12
#: Dense fp8 (e4m3) matrix product on the H200.
DEFAULT_FP8_RATE = 1250e12

NO_CUDA = ("serveattn.bench needs a CUDA GPU, and torch.cuda.is_available() is False on this machine "
           "(torch {torch}), so there is nothing to time.")


def require_cuda() -> None:
    """Exits with one sentence when there is no CUDA device."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit(NO_CUDA.format(torch=torch.__version__))


@dataclasses.dataclass
class Ceilings:
    """Bandwidth in bytes/s (read + write) and matrix rates in flop/s, with where each came from."""

    bandwidth: float = DEFAULT_BANDWIDTH
    bf16_rate: float = DEFAULT_BF16_RATE
    fp8_rate: float = DEFAULT_FP8_RATE
    source: Dict[str, str] = dataclasses.field(default_factory=lambda: {
        "bandwidth": "default (H200 device copy, baseline 2026-12-02)",
        "bf16_rate": "default (H200 bf16 matmul, baseline 2026-12-02)",
        "fp8_rate": "default (H200 fp8 e4m3 matmul, baseline 2026-12-02)",
    })

    def rate(self, dtype_name: str) -> float:
        return self.fp8_rate if "fp8" in dtype_name or "float8" in dtype_name else self.bf16_rate

    def describe(self) -> str:
        return (f"copy {self.bandwidth / 1e12:.2f} TB/s [{self.source['bandwidth']}]; "
                f"bf16 {self.bf16_rate / 1e12:.0f} TFLOP/s [{self.source['bf16_rate']}]; "
                f"fp8 {self.fp8_rate / 1e12:.0f} TFLOP/s [{self.source['fp8_rate']}]")

    def to_json(self) -> dict:
        return {"bandwidth_Bps": self.bandwidth, "bf16_flops": self.bf16_rate, "fp8_flops": self.fp8_rate,
                "source": dict(self.source)}


def measure_ceilings(warmup_ms: float = 25, rep_ms: float = 100) -> Ceilings:
    """Measures the copy bandwidth and the matrix rates on this device, on random data, now.

    Copy: ``dst.copy_(src)`` of a 1 GiB bf16 tensor, counting bytes read plus bytes written.
    bf16: ``torch.matmul`` of two 8192 x 8192 bf16 matrices into a preallocated output, 2 * 8192^3 flop.
    fp8: ``torch._scaled_mm`` of two 8192 x 8192 e4m3 matrices, if this torch has it; else the default.
    """
    import torch

    c = Ceilings()
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(1234)

    n = 1 << 29  # 512 Mi bf16 elements = 1 GiB
    src = torch.randn(n, dtype=torch.bfloat16, device=dev, generator=g)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), warmup_ms, rep_ms)
    c.bandwidth = 2 * src.numel() * src.element_size() / (ms * 1e-3)
    c.source["bandwidth"] = f"measured: 1 GiB bf16 device copy, read+write, {ms:.3f} ms"
    del src, dst

    m = 8192
    a = torch.randn(m, m, dtype=torch.bfloat16, device=dev, generator=g)
    b = torch.randn(m, m, dtype=torch.bfloat16, device=dev, generator=g)
    out = torch.empty(m, m, dtype=torch.bfloat16, device=dev)
    ms = bench_ms(lambda: torch.matmul(a, b, out=out), warmup_ms, rep_ms)
    c.bf16_rate = 2 * m ** 3 / (ms * 1e-3)
    c.source["bf16_rate"] = f"measured: torch.matmul bf16 8192^3, {ms:.3f} ms"

    try:
        a8 = a.to(torch.float8_e4m3fn)
        b8 = b.to(torch.float8_e4m3fn).t().contiguous().t()  # column-major second operand
        one = torch.ones((), dtype=torch.float32, device=dev)
        torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        ms = bench_ms(lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                      warmup_ms, rep_ms)
        c.fp8_rate = 2 * m ** 3 / (ms * 1e-3)
        c.source["fp8_rate"] = f"measured: torch._scaled_mm e4m3 8192^3, {ms:.3f} ms"
    except Exception as exc:  # noqa: BLE001 - a missing fp8 path keeps the default, with the reason
        c.source["fp8_rate"] = f"default (fp8 not measured: {one_line(exc)})"
    del a, b, out
    torch.cuda.empty_cache()
    return c


# ---------------------------------------------------------------- floors

def floors(flops: float, nbytes: float, ceilings: Ceilings, dtype_name: str = "bf16") -> dict:
    """The two lower bounds on time (ms): flops over the matrix rate and bytes over the copy bandwidth."""
    flops_ms = flops / ceilings.rate(dtype_name) * 1e3
    bytes_ms = nbytes / ceilings.bandwidth * 1e3
    return {"flops": flops, "bytes": nbytes, "flops_floor_ms": flops_ms, "bytes_floor_ms": bytes_ms,
            "floor_ms": max(flops_ms, bytes_ms), "bound": "compute" if flops_ms >= bytes_ms else "memory"}


# ---------------------------------------------------------------- timing

_clocks_up = False


def raise_clocks(ms: float = 500.0) -> None:
    """Keeps the GPU busy for ~ms once per process before the first timing: an idle H200 sits at 345 MHz, and the
    first case timed after it came out up to 25% slow with a 25% spread (1x4096, sessions 9 and 10)."""
    global _clocks_up
    if _clocks_up:
        return
    import time

    import torch

    _clocks_up = True
    if not torch.cuda.is_available():
        return
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while (time.perf_counter() - t0) * 1e3 < ms:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


_first_timing_done = False


def discard_first_timing(ready: dict, timing: "Timing") -> None:
    """Times the first ready runner once per process and drops the number: the first timing in a process came out
    slow even after raise_clocks (H200, session 11: 1x4096 paged 465 TFLOP/s with an 18.9% spread in the bench, and
    322 against 546 in the next round of a probe), while every later case was steady."""
    global _first_timing_done
    if _first_timing_done or not ready:
        return
    _first_timing_done = True
    bench_ms(rotating(next(iter(ready.values())).fns), timing.warmup_ms, timing.rep_ms)


#: How the L2 is emptied before each timed call (``--flush``). "zero": triton.testing.do_bench's own, a 256 MB
#: buffer zeroed, which leaves the L2 full of dirty lines: the timed call's first misses write them back, so a call
#: that moves less than a few L2 sizes also pays up to one L2 of DRAM writes. "read": the same buffer read (a sum),
#: which evicts as much and leaves the L2 holding clean lines (as after a read-mostly kernel, e.g. a GEMM over
#: weights); do_bench's loop otherwise (its estimate, warm-up and repetition counts, the median).
FLUSHES = ("zero", "read")
FLUSH = "zero"
_flush_buffer = []


def bench_ms(fn: Callable[[], object], warmup_ms: float, rep_ms: float) -> float:
    """Median time of one call of ``fn`` in ms (CUDA events, the L2 emptied before every repetition as ``FLUSH``
    says: triton.testing.do_bench itself for "zero")."""
    raise_clocks()
    if FLUSH == "zero":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    return _bench_read_flush(fn, warmup_ms, rep_ms)


def timing_phrase() -> str:
    """How bench_ms times, for the reports' footers."""
    if FLUSH == "zero":
        return "triton.testing.do_bench (L2 flushed by zeroing 256 MB before every call"
    return "do_bench's loop (L2 flushed by reading 256 MB before every call, --flush read: a clean L2"


def _estimate_ms(fn: Callable[[], object], step: Callable[[], object]) -> float:
    """ms per ``step()`` over 5 of them, after one ``fn()`` and a sync (do_bench's estimate of a repetition)."""
    import torch

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 5


def _bench_read_flush(fn: Callable[[], object], warmup_ms: float, rep_ms: float,
                      after_flush: Optional[Callable[[], object]] = None) -> float:
    """do_bench's loop with the flush a read of 256 MB instead of a write of it (FLUSH above). after_flush: run
    after each flush, outside the timing (scripts/probe_table_warm.py brings a plan's small arrays back into the
    L2 with it)."""
    import torch

    if not _flush_buffer:
        _flush_buffer.append(torch.ones(64 << 20, dtype=torch.int32, device="cuda"))
    buf = _flush_buffer[0]

    def flush():
        torch.sum(buf)
        if after_flush is not None:
            after_flush()

    def step():
        flush()
        fn()

    estimate_ms = _estimate_ms(fn, step)
    for _ in range(max(1, int(warmup_ms / estimate_ms))):
        fn()
    n = max(1, int(rep_ms / estimate_ms))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for i in range(n):
        flush()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return float(statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)))


def rotating(fns: Sequence[Callable[[], object]]) -> Callable[[], object]:
    """One callable that runs ``fns`` in turn: rotating among input sets keeps caches from helping."""
    fns = list(fns)
    if len(fns) == 1:
        return fns[0]
    state = [0]

    def call():
        i = state[0]
        state[0] = (i + 1) % len(fns)
        return fns[i]()

    return call


def back_to_back_ms(fn: Callable[[], object], warmup_ms: float, rep_ms: float) -> float:
    """Mean time per call of ``fn`` called back to back (ms): CUDA events around a loop of calls, no L2 flush.

    Unlike ``bench_ms`` (where a cache flush precedes every call and gives the host time to enqueue the next
    launch), this is bounded below by the host's time per call as well as the device's, so launch overhead
    shows. Rotate ``fn`` over inputs larger than the L2 (``rotating``) so that the loop does not read from L2.
    """
    import torch

    estimate = max(_estimate_ms(fn, fn), 1e-4)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(max(1, int(warmup_ms / estimate))):
        fn()
    n = max(10, int(rep_ms / estimate))
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return float(start.elapsed_time(end) / n)


def capture_cuda_graphs(calls: Sequence[Callable[[], object]]):
    """Runs each call once on a side stream (the warm-up: compilation, lazy allocation), then captures each
    into its own ``torch.cuda.CUDAGraph`` (one memory pool each). Returns ``(graphs, results)``, ``results[i]``
    being what call i returned during its capture (its static output, rewritten by every ``graphs[i].replay()``).
    The caller keeps whatever the calls reference (wrappers, workspaces, inputs) alive as long as the graphs.
    """
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graphs, results = [], []
    for call in calls:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            results.append(call())
        graphs.append(graph)
    torch.cuda.synchronize()
    return graphs, results


#: L2 size assumed when the device does not report one (the H200's is 60 MB).
DEFAULT_L2_BYTES = 60 * 2 ** 20


def l2_cache_bytes() -> int:
    """The L2 size of CUDA device 0 as torch reports it, else ``DEFAULT_L2_BYTES``."""
    import torch

    try:
        n = int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) or 0)
    except Exception:  # noqa: BLE001
        n = 0
    return n if n > 0 else DEFAULT_L2_BYTES


def rotation_sets(bytes_per_set: float, minimum: int, l2_bytes: float, l2_multiple: float,
                  cap: int = 64) -> int:
    """How many input sets to rotate among: ``minimum``, raised until the sets hold ``l2_multiple`` times the L2
    (so each call finds its inputs evicted by the calls in between), at most ``cap``."""
    need = math.ceil(l2_multiple * l2_bytes / bytes_per_set) if l2_multiple > 0 and bytes_per_set > 0 else 1
    return max(1, int(minimum), min(int(cap), need))


_FLASHINFER: Dict[str, object] = {}


def import_flashinfer():
    """``import flashinfer`` once per process; raises ModuleNotFoundError with the one-line reason otherwise."""
    if "mod" not in _FLASHINFER:
        try:
            import flashinfer  # noqa: F401

            _FLASHINFER["mod"] = flashinfer
        except Exception as exc:  # noqa: BLE001
            _FLASHINFER["mod"] = None
            _FLASHINFER["why"] = f"flashinfer not importable ({one_line(exc, 120)})"
    if _FLASHINFER["mod"] is None:
        raise ModuleNotFoundError(_FLASHINFER["why"])
    return _FLASHINFER["mod"]


def timed_first_call(fn: Callable[[], object]):
    """Runs ``fn`` once (compilation, JIT, autotuning) and returns (result, seconds), synchronized."""
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref|| in float32; NaN when ``out`` has a non-finite element."""
    import torch

    o = out.float()
    r = ref.float()
    if not bool(torch.isfinite(o).all()):
        return float("nan")
    return float(torch.linalg.vector_norm(o - r) / torch.linalg.vector_norm(r).clamp_min(1e-30))


def tflops(flops: float, ms: Optional[float]) -> Optional[float]:
    if ms is None or not ms > 0:
        return None
    return flops / (ms * 1e-3) / 1e12


def summarize_passes(ms_runs: List[float]) -> dict:
    """Mean of the pass medians and the spread between passes (max - min over mean)."""
    ms_runs = [m for m in ms_runs if m is not None and math.isfinite(m)]
    if not ms_runs:
        return {"ms": None, "ms_runs": [], "spread": None}
    mean = sum(ms_runs) / len(ms_runs)
    spread = (max(ms_runs) - min(ms_runs)) / mean if len(ms_runs) > 1 else None
    return {"ms": mean, "ms_runs": ms_runs, "spread": spread}


# ---------------------------------------------------------------- runners

#: How the peer cells state the ratio; the same in every family's tables and JSON.
RATIO_NOTE = "ratio = peer time / our time (above 1: ours is faster)"


def identity(out, meta):
    return out


class Declined(Exception):
    """A peer that cannot take the case (run_runners reports it as 'declined', with the sentence)."""


@dataclasses.dataclass
class Prepared:
    """A runner ready to time: one call per input set, how to compare its output, what to say about it."""

    fns: List[Callable[[], object]]
    note: str = ""
    normalize: Callable = identity  # (output, meta) -> the layout of the family's reference
    poisoned: Optional[Callable[[], object]] = None  # a call on set 0 whose every output element is checked
    keep: object = None  # what the calls need alive (wrappers, workspaces, graphs, static outputs)
    #: ``poisoned`` passes ``out=`` (``poisoned_call``): a TypeError naming ``out`` from it means that ``run`` refused
    #: the keyword, and the check falls back to ``fns[0]``. False where ``poisoned`` is something else (a graph replay).
    poisoned_passes_out: bool = True


def first(out):
    """The output tensor of a call that returns it alone or first in a tuple (``return_lse``)."""
    return out[0] if isinstance(out, (tuple, list)) else out


def poisoned_call(run, args, like):
    """A call that passes ``out=`` filled with NaN, so an unwritten element shows as a failed check."""
    import torch

    def call():
        out = torch.full_like(like, float("nan"))
        res = first(run(*args, out=out))
        return res if res is not None else out

    return call


def poisoned_replay(static, graph):
    """A check call for a captured graph: its static output filled with NaN, then one replay, then the output
    (an element the kernel did not write stays NaN)."""

    def call():
        static.fill_(float("nan"))
        graph.replay()
        return static

    return call


def workspace(nbytes: int, device):
    """A uint8 workspace buffer of ``nbytes`` on ``device`` for a wrapper."""
    import torch

    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def sdpa_call(backend, q, k, v, gqa: bool, causal: bool):
    """torch SDPA restricted to ``backend``; ``is_causal=True`` only when ``causal`` (a decode query sees every key)."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    kwargs = {"is_causal": True} if causal else {}
    with sdpa_kernel(backend):
        if gqa:
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kwargs)
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


def sdpa_fns(backend_name: str, sets, group: int, causal: bool):
    """One SDPA call per input set on its contiguous ``qb``, ``kb``, ``vb``: with ``enable_gqa=True`` when set 0's call
    takes it, else with K/V repeated ``group`` times along the heads (outside the timing).

    Returns ``(fns, refused)``: ``refused`` is None, or the exception with which the backend refused GQA.
    """
    import torch
    from torch.nn.attention import SDPBackend

    backend = getattr(SDPBackend, backend_name)
    s0 = sets[0]
    try:
        sdpa_call(backend, s0.qb, s0.kb, s0.vb, True, causal)
        torch.cuda.synchronize()
        return [functools.partial(sdpa_call, backend, s.qb, s.kb, s.vb, True, causal) for s in sets], None
    except Exception as exc:  # noqa: BLE001 - the backend refused GQA: repeat K/V outside the timing
        fns = []
        for s in sets:
            kr = s.kb.repeat_interleave(group, dim=1).contiguous()
            vr = s.vb.repeat_interleave(group, dim=1).contiguous()
            fns.append(functools.partial(sdpa_call, backend, s.qb, kr, vr, False, causal))
        return fns, exc


def sdpa_reference(prepare_sdpa: Callable, meta, s0):
    """SDPA output on input set 0 in the family's reference layout (``Prepared.normalize``), and what computed it:
    the flash backend, else memory-efficient, else cuDNN. ``prepare_sdpa(backend_name, meta, sets)`` is the
    family's SDPA runner."""
    import torch

    errors = []
    for name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"):
        try:
            prep = prepare_sdpa(name, meta, [s0])
            out = prep.fns[0]()
            torch.cuda.synchronize()
            return prep.normalize(out, meta).clone(), f"torch SDPA {name.lower()} ({prep.note})"
        except Exception as exc:  # noqa: BLE001
            errors.append(f"{name}: {one_line(exc, 100)}")
    raise RuntimeError("no SDPA backend could compute the reference: " + "; ".join(errors))


_FLEX: Dict[str, object] = {}


def compiled_flex(owner: str, recompile_limit: Optional[int] = None):
    """``torch.compile(flex_attention, dynamic=False)``, compiled once per ``owner`` (a family) per process.

    ``recompile_limit``: when this owner compiles, raise dynamo's recompile limit to at least this (past it,
    flex_attention would silently run uncompiled).
    """
    if owner not in _FLEX:
        import torch
        from torch.nn.attention.flex_attention import flex_attention

        if recompile_limit is not None:
            import torch._dynamo

            cfg = torch._dynamo.config
            name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
            if getattr(cfg, name, recompile_limit) < recompile_limit:
                setattr(cfg, name, recompile_limit)
        _FLEX[owner] = torch.compile(flex_attention, dynamic=False)
    return _FLEX[owner]


# ---------------------------------------------------------------- the run

def split_list(text: str) -> List[str]:
    """'a, b,,c' -> ['a', 'b', 'c']."""
    return [x.strip() for x in text.split(",") if x.strip()]


def case_names(args, workloads, quick_workloads) -> List[str]:
    """``--cases`` as a list, else the family's workloads (its quick ones with ``--quick``); not validated."""
    cases = getattr(args, "cases", None)
    if cases:
        return split_list(cases)
    return list(quick_workloads) if bool(getattr(args, "quick", False)) else list(workloads)


def select_peers(args, family: str, peer_keys: Sequence[str]) -> List[str]:
    """``--peers`` (default: all, 'none': none) as a list in the family's order; exits with a sentence on a bad one."""
    peers = (getattr(args, "peers", None) or ",".join(peer_keys)).strip()
    names = [] if peers == "none" else split_list(peers)
    bad = [p for p in names if p not in peer_keys]
    if bad:
        raise SystemExit(f"{family}: unknown peer(s) {bad}; choose from {list(peer_keys)} or 'none'.")
    return [k for k in peer_keys if k in names]


@dataclasses.dataclass
class Timing:
    """The timing options of a run, defaults filled in (``--quick`` has shorter ones)."""

    warmup_ms: float
    rep_ms: float
    passes: int
    sets: int

    @classmethod
    def from_args(cls, args) -> "Timing":
        quick = bool(getattr(args, "quick", False))
        return cls(warmup_ms=args.warmup_ms if args.warmup_ms is not None else (10 if quick else 25),
                   rep_ms=args.rep_ms if args.rep_ms is not None else (40 if quick else 100),
                   passes=args.passes if args.passes is not None else (1 if quick else 2),
                   sets=args.sets if args.sets is not None else (1 if quick else 2))


def new_result(family: str, config: dict, flops_formula: str, bytes_formula: str) -> dict:
    """A family's result before its cases run (the JSON keys every family has)."""
    return {"family": family, "ok": True, "config": config, "flops_formula": flops_formula,
            "bytes_formula": bytes_formula, "ratio": RATIO_NOTE, "cases": []}


def run_cases(family: str, result: dict, names: Sequence[str], n_runners: int, passes: int,
              run_case: Callable, checkpoint: Callable[[dict], None]) -> None:
    """``run_case(name, index, bar) -> case`` for each workload under one progress bar; appends each case to
    ``result["cases"]``, folds its ``ours_ok`` into ``result["ok"]`` and checkpoints after each."""
    import torch

    bar = Progress(len(names) * n_runners * (1 + passes), family)
    try:
        for wi, name in enumerate(names):
            case = run_case(name, wi, bar)
            result["cases"].append(case)
            result["ok"] = result["ok"] and case["ours_ok"]
            checkpoint(result)
            torch.cuda.empty_cache()
    finally:
        bar.close()


def case_reference(case: dict, reference: Callable, meta, s0):
    """The reference output on set 0 (None when it cannot be had); sets ``case["reference"]`` to what it is."""
    try:
        ref, case["reference"] = reference(meta, s0)
    except Exception as exc:  # noqa: BLE001
        ref, case["reference"] = None, f"none ({one_line(exc)})"
    return ref


def spread_note(r: dict) -> str:
    """' (spread 1.2%)' for a progress line, or '' with one pass."""
    return f" (spread {100 * r['spread']:.1f}%)" if r.get("spread") is not None else ""


def run_runners(case: dict, runners: Sequence[str], prepare: Callable[[str], Prepared], *, titles: dict,
                our_keys: Sequence[str], meta, ref, tol: float, timing: Timing, bar: Progress,
                first_call_label: str, measure: Callable[[str, dict, List[float]], str],
                back_to_back: bool = False) -> None:
    """Prepares, checks and times every runner of one case, filling ``case["runners"]`` and ``case["ours_ok"]``.

    Each runner: ``prepare(key)``, a first call (compilation, JIT, autotuning; the poisoned one where there is one)
    whose output is checked against ``ref`` (relative norm below ``tol``), a warm-up call on every other input set.
    A runner that fails or is wrong is a row in the tables, never a crash, and is not timed. Then ``timing.passes``
    passes, each timing every ready runner in turn (``bench_ms``, and ``back_to_back_ms`` when ``back_to_back``),
    so that drift shows as spread. Last, for each timed runner, ``summarize_passes`` and
    ``measure(key, r, back_to_back_runs)``, which adds the family's metrics to ``r`` and returns the rest of its
    progress line.
    """
    import torch

    name = case["name"]
    ready = {}
    for key in runners:
        ours = key in our_keys
        r = {"title": titles[key], "ours": ours, "status": "ok", "reason": None, "note": "",
             "err": None, "first_call_s": None}
        bar.status(f"{name} {key}: prepare")
        prep = None
        try:
            t0 = time.perf_counter()
            prep = prepare(key)
            r["note"] = prep.note
            try:  # warm-up (compile, JIT, autotune) and the output for the check, outside the timing
                out, _ = timed_first_call(prep.poisoned or prep.fns[0])
            except TypeError as exc:
                if prep.poisoned is None or not prep.poisoned_passes_out or "out" not in str(exc):
                    raise
                out, _ = timed_first_call(prep.fns[0])
                prep.note += f"; run(out=...) refused ({one_line(exc, 80)}), unwritten elements not checked"
                r["note"] = prep.note
            r["first_call_s"] = time.perf_counter() - t0
            if ref is not None:
                r["err"] = rel_err(prep.normalize(first(out), meta), ref)
                if not (r["err"] < tol):
                    r["status"] = "wrong"
                    r["reason"] = (f"relative error {r['err']:.3g} against {case['reference'].split(' (')[0]} "
                                   f"(tolerance {tol}; NaN means an unwritten or non-finite output)")
            elif ours:
                r["status"] = "unchecked"
                r["reason"] = f"no reference: {case['reference']}"
            del out
            for fn in prep.fns[1:]:
                fn()
            torch.cuda.synchronize()
            if r["status"] in ("ok", "unchecked"):
                ready[key] = prep
        except Declined as exc:
            r["status"], r["reason"] = "declined", str(exc)
        except Exception as exc:  # noqa: BLE001 - a failing runner is a line in the table, never a crash
            r["status"] = "failed"
            r["reason"] = one_line(exc)
        del prep
        if ours and r["status"] != "ok":
            case["ours_ok"] = False
        case["runners"][key] = r
        msg = f"[{name}] {key}: {r['status']}"
        if r["err"] is not None:
            msg += f", err {r['err']:.2e}"
        if r["first_call_s"] is not None:
            msg += f", {first_call_label} {r['first_call_s']:.1f} s"
        if r["reason"]:
            msg += f" - {r['reason']}"
        bar.log(msg)
        bar.update(1)

    runs = {k: [] for k in runners}
    b2b = {k: [] for k in runners}
    discard_first_timing(ready, timing)
    order = list(runners)
    for p in range(timing.passes):  # passes interleave the runners, so drift shows up as spread
        # each pass starts one runner later: the first runner timed after a check or another case meets a GPU
        # that has cooled (clocks up), and no runner should hold that place in every pass
        start = p % len(order)
        for key in order[start:] + order[:start]:
            bar.status(f"{name} {key}: pass {p + 1}/{timing.passes}")
            if key in ready:
                try:
                    fn = rotating(ready[key].fns)
                    runs[key].append(bench_ms(fn, timing.warmup_ms, timing.rep_ms))
                    if back_to_back:
                        b2b[key].append(back_to_back_ms(fn, timing.warmup_ms, timing.rep_ms))
                except Exception as exc:  # noqa: BLE001
                    r = case["runners"][key]
                    r["status"], r["reason"] = "failed", f"while timing: {one_line(exc)}"
                    ready.pop(key)
                    if r["ours"]:
                        case["ours_ok"] = False
            bar.update(1)

    for key in runners:
        r = case["runners"][key]
        if r["status"] in ("ok", "unchecked") and runs[key]:
            r.update(summarize_passes(runs[key]))
            bar.log(f"[{name}] {key}: " + measure(key, r, b2b[key]))


# ---------------------------------------------------------------- text

def one_line(exc: BaseException, limit: int = 200) -> str:
    """``TypeName: first line of the message``, cut to ``limit`` characters."""
    msg = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {msg[0] if msg else ''}".strip().rstrip(":")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def fmt(x: Optional[float], spec: str = ".3f", none: str = "-") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return none
    return format(x, spec)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub markdown table; ``|`` and newlines inside cells are escaped."""
    def cell(v) -> str:
        return str(v).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(cell(h) for h in headers) + " |",
             "| " + " | ".join("---" for _ in headers) + " |"]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def spread_cell(o: dict) -> str:
    """The 'spread' cell of a table: '1.2%', or '-' with one pass."""
    return fmt(100 * o["spread"], ".1f") + "%" if o.get("spread") is not None else "-"


def peer_cell(ours: dict, peer: dict, metric: Callable[[dict], str]) -> str:
    """A peer's cell in the row of one of our runners: ``metric(peer)`` and the ratio of its time to ours, or why
    it has no time."""
    if peer["status"] not in ("ok", "unchecked") or peer.get("ms") is None:
        reason = peer["reason"] or ""
        return f"{peer['status']}: {reason if len(reason) <= 70 else reason[:67] + '...'}"
    cell = metric(peer)
    if ours.get("ms"):
        cell += f", {peer['ms'] / ours['ms']:.2f}x"
    if "repeated" in peer.get("note", ""):
        cell += " (K/V repeated)"
    return cell


def ours_rows(cases: Sequence[dict], our_keys: Sequence[str], peers: Sequence[str], ok_cells: Callable[[dict], list],
              width: int, metric: Callable[[dict], str]) -> list:
    """The rows of 'serveattn against the peers': per case and our runner, the case, the runner, ``width`` cells of
    its own (``ok_cells(o)`` when timed, else the status and reason, dashes, and 'err' as the fifth), then a
    ``peer_cell`` per peer."""
    rows = []
    for c in cases:
        for key in our_keys:
            o = c["runners"].get(key)
            if o is None:
                continue
            ok = o["status"] in ("ok", "unchecked") and o.get("ms") is not None
            row = [c["name"], key]
            if ok:
                row += ok_cells(o)
            else:
                row += [f"{o['status'].upper()}: {o['reason']}", "-", "-", "-", fmt(o["err"], ".1e")]
                row += ["-"] * (width - 5)
            row += [peer_cell(o if ok else {}, c["runners"][p], metric) for p in peers]
            rows.append(row)
    return rows


def report_footer(result: dict, tol: float) -> List[str]:
    """The last lines of a family's report: the references, the tolerance, and a warning if ours failed."""
    refs = sorted({c.get("reference", "") for c in result["cases"]})
    lines = [f"reference for 'err': {'; '.join(refs)}; tolerance {tol} (relative norm)."]
    if not result["ok"]:
        lines += ["", "**serveattn failed or was wrong in at least one case: see the rows above.**"]
    return lines


class Progress:
    """A tqdm progress bar over the steps of a run, on stderr.

    On a terminal it is the usual bar and ``log`` prints above it. When stderr is a file or a pipe (the
    remote runs, ``2>&1 | tee``), a redrawn bar would fill the log with carriage returns, so the bar is
    drawn only as a prefix of each logged line (``12/40 [00:31<00:52]``).
    """

    def __init__(self, total: int, desc: str):
        from tqdm import tqdm

        self.total, self.desc, self.n = total, desc, 0
        self.t0 = time.time()
        self.tty = sys.stderr.isatty()
        self.bar = tqdm(total=total, desc=desc, file=sys.stderr, mininterval=0.5, dynamic_ncols=True,
                        disable=not self.tty, bar_format="{desc}: {n}/{total} |{bar}| {elapsed}<{remaining} {postfix}")

    def update(self, k: int = 1) -> None:
        self.n += k
        self.bar.update(k)

    def status(self, text: str) -> None:
        if self.tty:
            self.bar.set_postfix_str(text, refresh=True)

    def log(self, msg: str) -> None:
        from tqdm import tqdm

        if self.tty:
            tqdm.write(msg, file=sys.stderr)
        else:
            meter = tqdm.format_meter(self.n, self.total, time.time() - self.t0,
                                      bar_format="{n}/{total} [{elapsed}<{remaining}]")
            print(f"{self.desc} {meter} {msg}", file=sys.stderr, flush=True)

    def close(self) -> None:
        self.bar.close()


def log(msg: str) -> None:
    """A line on stderr that does not break a progress bar."""
    from tqdm import tqdm

    tqdm.write(msg, file=sys.stderr)


# ---------------------------------------------------------------- environment and JSON

def environment() -> dict:
    """Versions and the device, for the header of the output and the JSON."""
    import torch

    env = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception as exc:  # noqa: BLE001
        env["triton"] = f"unavailable ({one_line(exc)})"
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env["device"] = p.name
        env["capability"] = f"{p.major}.{p.minor}"
        env["sm_count"] = p.multi_processor_count
        env["memory_GiB"] = round(p.total_memory / 2 ** 30, 1)
    env["env"] = {k: os.environ[k] for k in ("TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES") if k in os.environ}
    return env


def _clean(x):
    """NaN/inf become null so the file is strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def write_json(path: Optional[str], payload: dict) -> None:
    """Writes ``payload`` atomically (a partial run still leaves a readable file)."""
    if not path:
        return
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(_clean(payload), f, indent=2, default=str)
        f.write("\n")
    os.replace(tmp, path)
