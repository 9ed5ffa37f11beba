"""Host cost of one decode/prefill call on the GPU: plan(), run(), the bare Triton launch inside run(), and the
per-step re-plan of the CUDA-graph wrapper.

Usage (on the GPU machine): PYTHONPATH=$PWD python3 scripts/probe_host.py [--profile]

With FlashInfer importable (gpu_run.sh fi-setup first) the decode part also times FlashInfer's plan() and run() on
the same inputs: the same host's cost for the peer.

--profile also prints where the host time of the batch-256 bandwidth-route plan() and run() goes (cProfile,
functions by own time): Triton's binder and launcher against our argument assembly and staging.
--prefill: eager prefill run() of short requests (ragged and paged, bf16, GQA 32/8), its host time per call against
its GPU time (do_bench, L2 flushed), the bare kernel launch inside it, a Triton kernel of two arguments for scale,
and with --profile where run()'s host time goes. (Session 12's crossover run had our ragged prefill at ~0.1 ms for
512 tokens, 3x cuDNN's eager time, which suggests the host.)
--fast-launch-ab: run() host time of decode (batch 1 and 256, bandwidth route) and ragged prefill 1x512 with
kernels/launch.py's fast path off and on (launch.ENABLED, i.e. SERVEATTN_FAST_LAUNCH), alternating in one process
over --rounds rounds; prints each round and the median per setting. With --profile, cProfile of the fast-path run().
"""
import argparse
import cProfile
import pstats
import time

import torch
import triton
import triton.language as tl
import triton.testing

import serveattn
from host_timing import best_us  # scripts/, beside this file
from serveattn import staging
from serveattn.kernels import decode as decode_kernel
from serveattn.kernels import launch as fast_launch


def _flashinfer():
    """flashinfer, or None (the reason printed once) where it is not importable (gpu_run.sh fi-setup provides it)."""
    from serveattn.bench.common import import_flashinfer
    try:
        return import_flashinfer()
    except ModuleNotFoundError as exc:
        if not getattr(_flashinfer, "told", False):
            print(f"({exc}; gpu_run.sh fi-setup provides it)")
            _flashinfer.told = True
        return None


def per_call_us(fn, n=300, rounds=5):
    """Host microseconds a call: the best of `rounds` rounds of n calls (the H200 hosts are noisy: single rounds of
    one probe read 28-46 us for the same call in session 19), after 20 warm-up calls."""
    return best_us(fn, 20, n, rounds, sync=torch.cuda.synchronize)


def profile(label, fn, n=300):
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    print(f"--- {label}: cProfile over {n} calls, by own time")
    pstats.Stats(prof).sort_stats("tottime").print_stats(22)


def _decode_inputs(batch: int, kv: int, dev: str):
    """(cache, indptr, indices, last_page_len, q, out): batch requests of kv keys, GQA 32/8, d128, bf16, pages of
    16 in shuffled order."""
    pages = (kv + 15) // 16
    cache = torch.randn(batch * pages, 2, 16, 8, 128, device=dev, dtype=torch.bfloat16)
    indptr = torch.arange(batch + 1, dtype=torch.int32, device=dev) * pages
    indices = torch.randperm(batch * pages, device=dev).to(torch.int32)
    last = torch.full((batch,), 16, dtype=torch.int32, device=dev)
    q = torch.randn(batch, 32, 128, device=dev, dtype=torch.bfloat16)
    return cache, indptr, indices, last, q, torch.empty_like(q)


def _ragged_prefill(s: int, ws, dev: str):
    """(planned ragged wrapper, q, k, v): one causal request of s tokens, GQA 32/8, d128, bf16."""
    q = torch.randn(s, 32, 128, device=dev, dtype=torch.bfloat16)
    qo = torch.tensor([0, s], dtype=torch.int32, device=dev)
    k, v = (torch.randn(s, 8, 128, device=dev, dtype=torch.bfloat16) for _ in range(2))
    w = serveattn.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend="triton")
    w.plan(qo, qo, 32, 8, 128, causal=True, q_data_type=torch.bfloat16)
    return w, q, k, v


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--prefill", action="store_true")
    ap.add_argument("--fast-launch-ab", action="store_true")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = "cuda"
    if args.fast_launch_ab:
        return fast_launch_ab(args.rounds, args.profile)
    if args.prefill:
        return prefill_host(args.profile)
    fi_ws = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
    for batch, kv in ((1, 8192), (256, 1024)):
        cache, indptr, indices, last, q, out = _decode_inputs(batch, kv, dev)
        ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
        for tc in (False, True):
            # backend="triton": the route use_tensor_cores names (auto may pick the other one)
            w = serveattn.BatchDecodeWithPagedKVCacheWrapper(ws, use_tensor_cores=tc, backend="triton")
            host_idx = (indptr.cpu(), indices.cpu(), last.cpu())
            plan_us = per_call_us(lambda: w.plan(*host_idx, 32, 8, 128, 16, q_data_type=torch.bfloat16), n=100)
            run_us = per_call_us(lambda: w.run(q, cache, out=out))
            print(f"decode batch {batch} kv {kv} tensor_cores={tc}: plan {plan_us:.1f} us, run {run_us:.1f} us")
            if args.profile and not tc:  # where a bandwidth-route run() goes, per batch (session 33: b1 2x b256)
                profile(f"decode run(), batch {batch}, bandwidth route", lambda: w.run(q, cache, out=out))
            # what a serving engine pays every step under CUDA graphs: a re-plan into the captured buffers
            i32 = dict(dtype=torch.int32, device=dev)
            g = serveattn.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(
                ws, torch.empty(batch + 1, **i32), torch.empty(indices.numel(), **i32), torch.empty(batch, **i32),
                use_tensor_cores=tc)
            replan_us = per_call_us(lambda: g.plan(*host_idx, 32, 8, 128, 16, q_data_type=torch.bfloat16), n=100)
            print(f"    CUDA-graph wrapper re-plan (captured buffers): {replan_us:.1f} us")
            if args.profile and batch == 256:
                profile(f"CUDA-graph decode re-plan, batch 256, {'tensor-core' if tc else 'bandwidth'} route",
                        lambda: g.plan(*host_idx, 32, 8, 128, 16, q_data_type=torch.bfloat16), n=100)
            fi = _flashinfer()
            if fi is not None:  # the peer's host cost on this host, same calls (after gpu_run.sh fi-setup)
                fw = fi.BatchDecodeWithPagedKVCacheWrapper(fi_ws, "NHD", use_tensor_cores=tc)
                fi_plan_us = per_call_us(lambda: fw.plan(*host_idx, 32, 8, 128, 16, q_data_type=torch.bfloat16,
                                                         kv_data_type=torch.bfloat16), n=100)
                fi_run_us = per_call_us(lambda: fw.run(q, cache, out=out))
                print(f"    FlashInfer {fi.__version__}, same calls: plan {fi_plan_us:.1f} us, run {fi_run_us:.1f} us")
            if not tc and w._plan is not None:
                p = w._plan
                k, v = cache[:, 0], cache[:, 1]
                # the wrapper's done_count as run() passes it (the fused merge: the merge arrays stay on the host)
                launch_us = per_call_us(lambda: decode_kernel.launch(q, k, v, out, None, p, "NHD", p.num_work_host,
                                                                    p.batch if p.num_slots else 0,
                                                                    done_count=w._done_count))
                print(f"    bare decode_kernel.launch (+merge: {bool(p.num_slots)}): {launch_us:.1f} us")
                if batch == 256:  # the staging step alone, and the CUDA calls it is made of
                    # the plan's own arrays are host numpy (tensors before session 30)
                    arrays = {n: torch.as_tensor(t).cpu() for n, t in (("work", p.work), ("num_work", p.num_work),
                                                      ("req_first_slot", p.req_first_slot),
                                                      ("req_num_slots", p.req_num_slots), ("kv_indptr", indptr),
                                                      ("kv_indices", indices), ("last_page_len", last))}
                    parts = {"staging.to_device (7 arrays)": lambda: staging.to_device(arrays, dev),
                             "torch.empty on the GPU": lambda: torch.empty(4096, dtype=torch.uint8, device=dev),
                             "torch.cuda.current_stream(device)": lambda: torch.cuda.current_stream(x0.device),
                             "a CUDA event record": lambda: ev.record(),
                             "a slice of a GPU tensor": lambda: x0[8:64]}
                    x0, ev = torch.empty(4096, dtype=torch.uint8, device=dev), torch.cuda.Event()
                    print("    " + "; ".join(f"{k} {per_call_us(f):.1f} us" for k, f in parts.items()))
                if args.profile and batch == 256:
                    profile("decode plan, batch 256, bandwidth route",
                            lambda: w.plan(*host_idx, 32, 8, 128, 16, q_data_type=torch.bfloat16), n=100)
                    profile("decode run, batch 256, bandwidth route", lambda: w.run(q, cache, out=out))
            if tc and args.profile and batch == 256:
                profile("decode plan, batch 256, tensor-core route",
                        lambda: w.plan(*host_idx, 32, 8, 128, 16, q_data_type=torch.bfloat16), n=100)
                profile("decode run, batch 256, tensor-core route", lambda: w.run(q, cache, out=out))
    t0 = time.perf_counter()
    x = torch.empty(1, device=dev)
    torch.cuda.synchronize()
    empty_us = per_call_us(lambda: x.add_(1.0))
    print(f"reference: a torch add_ launch {empty_us:.1f} us; total probe {time.perf_counter() - t0:.1f} s")


@triton.jit
def _two_args_kernel(x_ptr, n):
    pid = tl.program_id(0)
    tl.store(x_ptr + pid, pid.to(tl.float32), mask=pid < n)


def prefill_host(with_profile: bool):
    from serveattn.kernels import attention as attention_kernel
    dev = "cuda"
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    x = torch.empty(1, device=dev)
    print(f"reference: a torch add_ launch {per_call_us(lambda: x.add_(1.0)):.1f} us; a Triton kernel of two "
          f"arguments {per_call_us(lambda: _two_args_kernel[(1,)](x, 1)):.1f} us")
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from serveattn.kernels import attention_ws
    t = torch.randn(4096, 8, 128, device=dev, dtype=torch.bfloat16)
    desc_args = (t, [4096 * 8, 128], [128, 1], [16, 128])
    layout = attention_ws._smem_layout((16, 128), t.dtype)
    line = f"a TensorDescriptor {per_call_us(lambda: TensorDescriptor(*desc_args, layout)):.1f} us"
    if hasattr(attention_ws, "_tma_descriptor"):  # next/prefill-host: its checks made once per kind
        line += f"; attention_ws._tma_descriptor {per_call_us(lambda: attention_ws._tma_descriptor(*desc_args)):.1f} us"
    print(line)
    for kind, s in (("ragged", 512), ("ragged", 2048), ("paged", 512), ("paged", 2048)):
        if kind == "ragged":
            w, q, k, v = _ragged_prefill(s, ws, dev)
            call, kv = (lambda: w.run(q, k, v)), (k, v)
        else:
            q = torch.randn(s, 32, 128, device=dev, dtype=torch.bfloat16)
            qo = torch.tensor([0, s], dtype=torch.int32, device=dev)
            pages = s // 16
            cache = torch.randn(pages, 2, 16, 8, 128, device=dev, dtype=torch.bfloat16)
            indices = torch.randperm(pages, device=dev).to(torch.int32)
            w = serveattn.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="triton")
            w.plan(qo, torch.tensor([0, pages], dtype=torch.int32, device=dev), indices,
                   torch.tensor([16], dtype=torch.int32, device=dev), 32, 8, 128, 16, causal=True,
                   q_data_type=torch.bfloat16)
            # the K/V views run() takes (kept per cache: the plan's replay sees the same objects)
            call, kv = (lambda: w.run(q, cache)), serveattn.prefill._cache_views(w._caches, cache, "NHD")[:2]
        out = torch.empty_like(q)
        p = w._plan
        launch = lambda: attention_kernel.launch(q, kv[0], kv[1], out, None, p, "NHD", p.num_work_host,  # noqa: E731
                                                 gather_ok=True)  # as run() passes it: the plan's replay
        host, bare = per_call_us(call), per_call_us(launch)
        gpu = triton.testing.do_bench(call, warmup=25, rep=100) * 1e3
        print(f"prefill {kind} 1x{s}: run() host {host:.1f} us a call, GPU (do_bench) {gpu:.1f} us; bare "
              f"attention.launch {bare:.1f} us")
        fi = _flashinfer() if kind == "paged" else None
        if fi is not None:  # the peer's run() on the same host and inputs (fa3: the bench's JIT cache holds it)
            fw = fi.BatchPrefillWithPagedKVCacheWrapper(ws, kv_layout="NHD", backend="fa3")
            fw.plan(qo, torch.tensor([0, pages], dtype=torch.int32, device=dev), indices,
                    torch.tensor([16], dtype=torch.int32, device=dev), 32, 8, 128, 16, causal=True,
                    q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
            fi_call = lambda: fw.run(q, cache)  # noqa: E731
            print(f"    FlashInfer {fi.__version__} fa3, same call: run() host {per_call_us(fi_call):.1f} us, GPU "
                  f"{triton.testing.do_bench(fi_call, warmup=25, rep=100) * 1e3:.1f} us")
        if with_profile and s == 512:
            profile(f"prefill {kind} 1x{s} run()", call)


def fast_launch_ab(rounds: int, with_profile: bool):
    """run() host us a call with the fast launch path off and on, alternating (rates drift between processes)."""
    import statistics
    dev = "cuda"
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    calls = {}
    for batch, kv in ((1, 8192), (256, 1024)):
        cache, indptr, indices, last, q, out = _decode_inputs(batch, kv, dev)
        w = serveattn.BatchDecodeWithPagedKVCacheWrapper(ws, use_tensor_cores=False, backend="triton")
        w.plan(indptr.cpu(), indices.cpu(), last.cpu(), 32, 8, 128, 16, q_data_type=torch.bfloat16)
        calls[f"decode batch {batch} kv {kv} run()"] = (lambda w=w, q=q, c=cache, o=out: w.run(q, c, out=o))
    s = 512
    wp, q, k, v = _ragged_prefill(s, ws, dev)
    out_p = torch.empty_like(q)
    calls[f"prefill ragged 1x{s} run()"] = lambda: wp.run(q, k, v, out=out_p)
    times = {(name, on): [] for name in calls for on in (False, True)}
    for r in range(rounds):
        for on in ((False, True) if r % 2 == 0 else (True, False)):
            fast_launch.ENABLED = on
            for name, call in calls.items():
                times[(name, on)].append(per_call_us(call))
        last = {name: (times[(name, False)][-1], times[(name, True)][-1]) for name in calls}
        print(f"round {r}: " + "; ".join(f"{name} off {off:.1f} / on {on:.1f} us" for name, (off, on) in last.items()))
    print(f"--- fast launch A/B, median of {rounds} rounds (host us a call, {len(calls)} cases)")
    for name in calls:
        off, on = statistics.median(times[(name, False)]), statistics.median(times[(name, True)])
        print(f"{name}: off {off:.1f} us, on {on:.1f} us, saved {off - on:.1f} us ({off / on:.2f}x)")
    # the same outputs both ways (the GPU tests check bits; this is a smoke check of the probe's own calls)
    first = lambda result: (result[0] if isinstance(result, tuple) else result).clone()  # noqa: E731
    for name, call in calls.items():
        fast_launch.ENABLED = False
        a = first(call())
        fast_launch.ENABLED = True
        b = first(call())
        print(f"{name}: outputs bitwise equal off/on: {torch.equal(a, b)}")
    if with_profile:
        fast_launch.ENABLED = True
        for name, call in calls.items():
            profile(f"{name}, fast launch on", call)
    fast_launch.ENABLED = False


if __name__ == "__main__":
    main()
