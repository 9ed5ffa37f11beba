"""vLLM's FlashInfer decode under full CUDA graphs, with its fast path replaced by plan() (serveattn has no
FlashInfer internals for fast_plan_decode to write): one graph wrapper per padded batch size, all sharing one
workspace, one page-index buffer and slices of one indptr / last-page buffer; every step writes the page ids into
the shared index buffer on the device, plans with host indptr / last_page_len and that device view in FlashInfer
0.7's positional order, and replays the size's graph. Sizes interleave, so a plan of one wrapper between another's
capture and replay must not disturb it."""
import pytest
import torch

import serveattn
from serveattn import reference
from helpers import rel_err, tolerance

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16
HQ, HKV, D, PAGE, NUM_PAGES, MAX_REQS = 32, 8, 128, 16, 4096, 16


def _step_table(gen, batch, real, max_kv):
    """vLLM's padded batch: `real` requests of random lengths, the padding requests empty."""
    kv_lens = [int(x) for x in torch.randint(1, max_kv + 1, (real,), generator=gen)] + [0] * (batch - real)
    pages = [-(-k // PAGE) for k in kv_lens]
    indptr = torch.tensor([0] + torch.cumsum(torch.tensor(pages), 0).tolist(), dtype=torch.int32)
    last = torch.tensor([k - (p - 1) * PAGE if p else 0 for k, p in zip(kv_lens, pages)], dtype=torch.int32)
    ids = torch.randperm(NUM_PAGES, generator=gen)[: int(indptr[-1])].to(torch.int32)
    return indptr, ids, last


@pytest.mark.parametrize("use_tensor_cores", [True, False])
def test_vllm_graph_wrappers_share_buffers_and_replan_each_step(use_tensor_cores):
    gen = torch.Generator().manual_seed(53)
    cache = torch.randn(NUM_PAGES, 2, PAGE, HKV, D, generator=gen).to(BF16).cuda()
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    indptr_gpu = torch.zeros(MAX_REQS + 1, dtype=torch.int32, device="cuda")
    indices_gpu = torch.zeros(NUM_PAGES, dtype=torch.int32, device="cuda")
    last_gpu = torch.zeros(MAX_REQS, dtype=torch.int32, device="cuda")
    sizes = (1, 4, 16)
    wrappers, graphs, qs, outs = {}, {}, {}, {}

    def plan(batch, real, max_kv):
        indptr, ids, last = _step_table(gen, batch, real, max_kv)
        indices_gpu[: ids.numel()].copy_(ids)  # vLLM's page-id kernel writes the shared buffer on the device
        wrappers[batch].plan(indptr, indices_gpu[: ids.numel()], last, HQ, HKV, D, PAGE, "NONE", -1, None, BF16,
                             BF16, BF16, None, 0.0883883, None, None, True, None, None, -1, False)
        return indptr, ids, last

    for batch in sizes:  # capture, as vLLM does at start-up: a first plan and run, then the captured run
        wrappers[batch] = serveattn.BatchDecodeWithPagedKVCacheWrapper(
            ws, "NHD", use_cuda_graph=True, paged_kv_indptr_buffer=indptr_gpu[: batch + 1],
            paged_kv_indices_buffer=indices_gpu, paged_kv_last_page_len_buffer=last_gpu[:batch],
            use_tensor_cores=use_tensor_cores)
        qs[batch] = torch.randn(batch, HQ, D, generator=gen).to(BF16).cuda()
        outs[batch] = torch.empty_like(qs[batch])
        plan(batch, batch, 2000)
        wrappers[batch].run(qs[batch], cache, out=outs[batch])
        torch.cuda.synchronize()
        graphs[batch] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[batch]):
            wrappers[batch].run(qs[batch], cache, out=outs[batch])
    steps = [(16, 13, 3000), (1, 1, 9000), (4, 3, 500), (16, 16, 200), (4, 4, 6000), (1, 1, 17)]
    for step, (batch, real, max_kv) in enumerate(steps):
        table = plan(batch, real, max_kv)
        qs[batch].copy_(torch.randn(batch, HQ, D, generator=gen).to(BF16))
        outs[batch].fill_(float("nan"))
        graphs[batch].replay()
        torch.cuda.synchronize()
        ref_out, _ = reference.batch_paged(qs[batch], cache, torch.arange(batch + 1, dtype=torch.int32), *table,
                                           sm_scale=0.0883883)
        assert not outs[batch][:real].isnan().any(), step
        assert rel_err(outs[batch][:real], ref_out[:real]) < tolerance(BF16), step
        # the eager run of the same plan gives the replay's bits
        assert torch.equal(wrappers[batch].run(qs[batch], cache)[:real], outs[batch][:real]), step
