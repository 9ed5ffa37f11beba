"""Does the page table's DRAM trip explain a paged decode's gap to cuDNN on contiguous K/V at small steps?

Under the bench's flush every array a kernel reads starts in DRAM, the plan's page table and work list too; in
serving they were just written by plan() (or copied into a CUDA graph's buffers) and sit in the L2. Our paged
kernel must read a program's page indices before it can ask for K/V (one more DRAM round trip than cuDNN's
contiguous reads). This times bench decode's runners (ours cc eager and CUDA graph, cuDNN's graph) under the clean
flush (common's "read"), then the same with the plan's small device arrays (work list, its count, the split
slots, kv_indptr, kv_indices, last_page_len) read back into the L2 after each flush, outside the timing; in one
process, rounds alternating. Prediction (session 53): ours at 1x8192 ~0.7 us faster with the table warm (one DRAM trip), cuDNN
level; larger steps level.

    python3 scripts/probe_table_warm.py [--cases 1x8192,8x4096,32x2048] [--rounds 3]
"""
import argparse

import torch

from serveattn.bench import common, decode


def plan_arrays(wrapper):
    """The plan's device arrays a decode kernel reads besides q and the cache (those it has)."""
    plan = wrapper._plan
    return [t for t in (plan.work, plan.num_work, plan.req_first_slot, plan.req_num_slots, plan.kv_indptr,
                        plan.kv_indices, plan.last_page_len)
            if isinstance(t, torch.Tensor) and t.is_cuda]


def sums(tensors):
    """A call that reads each tensor (a sum apiece), bringing it into the L2."""
    return lambda: [t.sum() for t in tensors]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="1x8192,8x4096,32x2048")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    l2 = common.l2_cache_bytes()
    print(f"{torch.cuda.get_device_name()}; median us under the read flush (best of {args.rounds} rounds); "
          f"'warm': the plan's small arrays read after each flush")
    print("| case | runner | cold table us | warm table us | cold / warm |")
    print("| --- | --- | --- | --- | --- |")
    for wi, name in enumerate(common.split_list(args.cases)):
        batch, kv_len = decode.parse_case(name)
        meta = decode.build_meta(batch, kv_len, seed=wi)
        n_sets = common.rotation_sets(decode.kv_bytes(batch, kv_len), 2, l2, decode.L2_MULTIPLE, decode.MAX_SETS)
        sets = [decode.build_inputs(meta, seed=100 * wi + i) for i in range(n_sets)]
        runners = {"cc": decode.prepare_ours(False, False, meta, sets),
                   "cc-graph": decode.prepare_ours(False, True, meta, sets),
                   "cudnn-graph": decode.prepare_sdpa_graph("CUDNN_ATTENTION", meta, sets)}
        ours_wrapper = runners["cc"].keep
        graph_wrapper = runners["cc-graph"].keep[0]
        touched = {"cc": plan_arrays(ours_wrapper), "cc-graph": plan_arrays(graph_wrapper),
                   "cudnn-graph": plan_arrays(ours_wrapper)}  # the same small reads, so the timeline matches
        for key, prep in runners.items():
            fn = common.rotating(prep.fns)
            for f in prep.fns:
                f()
            arrays = touched[key]
            # cold: the same small sums, over arrays of the same sizes that no kernel reads
            strangers = [torch.empty_like(t) for t in arrays]
            best = {}
            for _ in range(args.rounds):
                for how, after_flush in (("cold", sums(strangers)), ("warm", sums(arrays))):
                    ms = common._bench_read_flush(fn, 15, 60, after_flush=after_flush)
                    best[how] = min(best.get(how, ms), ms)
            print(f"| {name} | {key} | {best['cold'] * 1e3:.1f} | {best['warm'] * 1e3:.1f} | "
                  f"{best['cold'] / best['warm']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
