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
