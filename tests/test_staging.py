"""One packed host->device copy of a plan's arrays: the round trip keeps every dtype, shape and value."""
import pytest
import torch

from serveattn import staging


def _arrays(gen):
    return dict(work=torch.randint(-5, 1000, (37,), generator=gen, dtype=torch.int32),
                num_work=torch.tensor([37], dtype=torch.int32),
                empty=torch.zeros(0, dtype=torch.int32),
                mask=torch.randint(0, 256, (13,), generator=gen, dtype=torch.int32).to(torch.uint8),
                tree=torch.tensor([1, -1, 2 ** 62, -(2 ** 63)], dtype=torch.int64),
                grid=torch.randint(0, 9, (3, 5), generator=gen, dtype=torch.int32).t())  # not contiguous


def test_pack_unpack_round_trip():
    arrays = _arrays(torch.Generator().manual_seed(0))
    blob, layout = staging.pack(arrays)
    assert blob.dtype == torch.uint8 and all(start % 16 == 0 for _, start, *_ in layout)
    back = staging.unpack(blob, layout)
    for name, t in arrays.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape and torch.equal(back[name], t), name


def test_to_device_copies_and_keeps_none(device):
    arrays = dict(_arrays(torch.Generator().manual_seed(1)), absent=None)
    out = staging.to_device(arrays, device)
    assert out["absent"] is None
    for name, t in arrays.items():
        if t is not None:
            assert out[name].device.type == torch.device(device).type and torch.equal(out[name].cpu(), t), name
            assert t.numel() == 0 or out[name].data_ptr() != t.data_ptr()  # never aliases the caller's tensor


def test_plan_arrays_start_16_byte_aligned_at_every_batch():
    """Triton compiles a kernel variant per pattern of 16-byte aligned pointer arguments: a plan's int32 arrays
    (sized by the batch) must all start 16-byte aligned whatever the batch, or a new batch size compiles mid-serving."""
    import numpy as np
    for batch in range(1, 70):
        arrays = dict(work=np.zeros(3 * batch + 1, np.int32), num_work=np.zeros(1, np.int32),
                      req_first_slot=np.zeros(batch, np.int32), req_num_slots=np.zeros(batch, np.int32),
                      kv_indptr=np.zeros(batch + 1, np.int32), kv_indices=np.zeros(7 * batch + 3, np.int32),
                      last_page_len=np.zeros(batch, np.int32))
        layout, total = staging._layout(arrays)
        assert all(start % 16 == 0 for _, start, *_ in layout) and total % 16 == 0, batch


@pytest.mark.gpu
def test_device_tensors_are_cloned_on_cuda():
    t = torch.arange(10, dtype=torch.int32, device="cuda")
    out = staging.to_device(dict(a=t, b=torch.arange(3, dtype=torch.int64)), "cuda")
    assert torch.equal(out["a"], t) and out["a"].data_ptr() != t.data_ptr() and out["b"].is_cuda


@pytest.mark.gpu
def test_pinned_ring_never_overwrites_a_copy_in_flight():
    """More plans than pinned buffers, back to back, behind a long kernel: every device copy keeps its bytes."""
    gen = torch.Generator().manual_seed(2)
    big = torch.randn(4096, 4096, device="cuda")
    big @ big  # keep the stream busy so the copies queue behind it
    sent = [dict(a=torch.randint(0, 1 << 30, (1000 + 97 * i,), generator=gen, dtype=torch.int32),
                 b=torch.randint(0, 1 << 30, (5,), generator=gen, dtype=torch.int64)) for i in range(3 * staging._RING)]
    got = [staging.to_device(arrays, "cuda") for arrays in sent]
    torch.cuda.synchronize()
    for arrays, out in zip(sent, got):
        for name, t in arrays.items():
            assert torch.equal(out[name].cpu(), t), name


def test_launch_sizes_match_triton():
    """kernels/sizes.py replaces Triton's ConstexprFunction helpers on the host path: the same values."""
    import triton

    from serveattn.kernels.sizes import cdiv, next_pow2
    for n in range(0, 300):
        assert next_pow2(n) == triton.next_power_of_2(n), n
        for b in (1, 3, 16, 64):
            assert cdiv(n, b) == triton.cdiv(n, b), (n, b)


def _plan_like(batch, pages):
    import numpy as np
    rng = np.random.default_rng(batch * 1000 + pages)
    return dict(work=rng.integers(0, 1 << 20, 4 * batch, dtype=np.int32), num_work=np.array([batch], np.int32),
                kv_indices=rng.permutation(pages).astype(np.int32), last_page_len=rng.integers(1, 17, batch,
                                                                                               dtype=np.int32))


def test_kept_layout_holds_rooms_while_arrays_fit():
    """A wrapper's next plan lands at the same offsets while every array fits its room (powers of two, 64 bytes at
    least, 16-byte aligned); a larger array or another set of names moves the layout."""
    kept = staging.Kept()
    layout, total, moved = staging._kept_layout(_plan_like(8, 100), kept)
    assert moved and all(start % 64 == 0 for _, start, *_ in layout)
    offsets = [start for _, start, *_ in layout]
    for batch, pages in ((7, 90), (8, 128), (1, 1)):  # every array still fits its room
        again, total2, moved = staging._kept_layout(_plan_like(batch, pages), kept)
        assert not moved and [s for _, s, *_ in again] == offsets and total2 == total, (batch, pages)
        assert [n for _, _, n, *_ in again] == [a.nbytes for a in _plan_like(batch, pages).values()]
    _, _, moved = staging._kept_layout(_plan_like(8, 129), kept)  # kv_indices outgrows its 512-byte room
    assert moved
    arrays = _plan_like(8, 129)
    del arrays["num_work"]
    _, _, moved = staging._kept_layout(arrays, kept)
    assert moved


def test_kept_views_are_made_again_only_where_an_array_changed():
    kept = staging.Kept()
    layout, total, _ = staging._kept_layout(_plan_like(8, 100), kept)
    blob = torch.zeros(total, dtype=torch.uint8)
    first = staging._kept_views(blob, layout, kept)
    layout2, _, moved = staging._kept_layout(_plan_like(8, 120), kept)
    second = staging._kept_views(blob, layout2, kept)
    assert not moved
    for name in first:
        assert (second[name] is first[name]) == (name != "kv_indices"), name
    assert second["kv_indices"].numel() == 120 and second["work"].data_ptr() == blob.data_ptr()


@pytest.mark.gpu
def test_kept_device_copies_keep_every_value_across_plans():
    """Plans one after another into one kept buffer, growing and shrinking, each read back by a kernel enqueued
    before the next plan (as run() would): every read sees its own plan's values, through the driver's copy."""
    kept = staging.Kept()
    big = torch.randn(4096, 4096, device="cuda")
    sizes = [(8, 100), (8, 120), (3, 20), (64, 2000), (64, 1990), (1, 1), (64, 2000)]
    sent, read = [], []
    for batch, pages in sizes:
        big @ big  # the stream stays busy: the copies queue behind the work before them
        arrays = _plan_like(batch, pages)
        out = staging.to_device(arrays, "cuda", kept)
        read.append({n: t.clone() for n, t in out.items()})  # enqueued now, on the same stream
        sent.append(arrays)
    torch.cuda.synchronize()
    for arrays, got in zip(sent, read):
        for name, a in arrays.items():
            assert torch.equal(got[name].cpu(), torch.from_numpy(a)), name
    assert (torch.device("cuda", torch.cuda.current_device()), True) in staging._rings
    assert staging._get_driver() is not None


@pytest.mark.gpu
def test_to_buffers_writes_each_array_at_its_buffers_start():
    """Re-plans under CUDA graphs write into the captured buffers: host arrays (numpy and torch) through one staged
    copy, a CUDA tensor by copy_, a strided buffer through torch; the bytes past each array stay as they were."""
    import numpy as np
    gen = torch.Generator().manual_seed(5)
    strided_base = torch.full((64,), -7, dtype=torch.int32, device="cuda")
    bufs = dict(a=torch.full((40,), -7, dtype=torch.int32, device="cuda"), b=strided_base[::2],
                c=torch.full((9,), -7, dtype=torch.int64, device="cuda"),
                d=torch.full((16,), -7, dtype=torch.int32, device="cuda"))
    arrays = dict(a=np.arange(33, dtype=np.int32) * 3, b=torch.randint(0, 99, (17,), generator=gen, dtype=torch.int32),
                  c=torch.randint(0, 1 << 40, (5,), generator=gen, dtype=torch.int64),
                  d=torch.arange(11, dtype=torch.int32, device="cuda"))
    torch.randn(4096, 4096, device="cuda") @ torch.randn(4096, 4096, device="cuda")  # the copies queue behind it
    captured = staging.Captured(bufs)
    assert set(captured.ptrs) == {"a", "c", "d"}  # the strided buffer goes through torch
    staging.to_buffers(arrays, captured)
    torch.cuda.synchronize()
    for name, t in arrays.items():
        t = torch.as_tensor(t).cpu()
        got = bufs[name].cpu()
        assert torch.equal(got[: t.numel()], t) and bool((got[t.numel():] == -7).all()), name
    assert bool((strided_base[1::2] == -7).all())


def test_captured_reads_each_buffer_once_and_to_buffers_fills_host_buffers():
    """staging.Captured holds what a re-plan asks of the captured buffers (capacity, dtype; addresses only for
    CUDA ones); to_buffers into host buffers goes through copy_ and leaves the bytes past each array alone."""
    import numpy as np
    bufs = dict(a=torch.full((8,), -7, dtype=torch.int32), b=torch.full((4,), -7, dtype=torch.int64))
    captured = staging.Captured(bufs)
    assert captured.caps == {"a": 8, "b": 4} and captured.dtypes == {"a": torch.int32, "b": torch.int64}
    assert captured.device is None and captured.ptrs == {} and captured["a"] is bufs["a"]
    assert staging.size(np.zeros(5)) == 5 and staging.size(torch.zeros(3, 2)) == 6
    staging.to_buffers(dict(a=np.arange(5, dtype=np.int32), b=torch.tensor([3, 4], dtype=torch.int64)), captured)
    assert bufs["a"].tolist() == [0, 1, 2, 3, 4, -7, -7, -7] and bufs["b"].tolist() == [3, 4, -7, -7]
