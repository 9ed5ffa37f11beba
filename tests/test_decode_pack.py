"""decode's launch.Pack (CPU, interpreter): the positions decode_kernel.launch declares fixed hold the plan's own
objects at every call of one kind, so the pack's cached key parts stay true; a tensor scale frees its position."""
import pytest
import torch

import serveattn
from serveattn.kernels import decode as decode_kernels


def _calls(monkeypatch):
    seen = []
    pack_class = decode_kernels.Pack  # decode's own: test_fast_launch reloads launch.py, which makes a new class
    real = pack_class.__call__

    def record(self, grid, *args):
        if self.jit_fn is decode_kernels.decode_kernel:
            seen.append((self, args))
        return real(self, grid, *args)

    monkeypatch.setattr(pack_class, "__call__", record)
    return seen


@pytest.mark.parametrize("k_scale", [None, 0.5, "tensor"])
def test_fixed_positions_are_the_plans_objects(monkeypatch, k_scale, device):
    seen = _calls(monkeypatch)
    batch, pages, page = 3, 4, 16
    indptr = torch.arange(batch + 1, dtype=torch.int32, device=device) * pages
    indices = torch.randperm(batch * pages, device=device).to(torch.int32)
    last = torch.tensor([16, 5, 9], dtype=torch.int32, device=device)
    cache = torch.randn(batch * pages, 2, page, 2, 64, dtype=torch.bfloat16, device=device)
    w = serveattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(8 << 20, dtype=torch.uint8, device=device),
                                                     backend="triton")
    w.plan(indptr, indices, last, 8, 2, 64, page, q_data_type=torch.bfloat16)
    for _ in range(2):  # new q, out and scale objects each call
        q = torch.randn(batch, 8, 64, dtype=torch.bfloat16, device=device)
        scale = torch.full((1,), 0.5, device=device) if k_scale == "tensor" else k_scale
        out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
        w.run(q, cache, k_scale=scale, out=out)
        assert torch.isfinite(out).all()
    (pack, first), (pack2, second) = seen
    assert pack is pack2 and len(first) == len(second) == pack.num_args
    fixed = dict(pack.fixed)
    assert all(first[i] is obj and second[i] is obj for i, obj in fixed.items())
    free = [i for i in range(len(first)) if i not in fixed]
    assert all(first[i] is not second[i] for i in (0, 3))  # q, out: new each call, never fixed
    assert 0 in free and 3 in free
    plan = w._plan
    assert fixed[5] is plan.part_o and fixed[6] is plan.part_lse
    scale_position = len(first) - 2  # k_scale's pointer
    assert (scale_position in fixed) == (k_scale != "tensor")
