"""Inputs the GPU probes share (scripts/, beside them)."""
import torch


def shuffled_pages(batch: int, kv: int, page_size: int, num_kv_heads: int, head_dim: int, spare: int = 7):
    """(indptr, indices, last_page_len, cache) of batch requests of kv keys each on pages of page_size, the pages in
    shuffled order among `spare` more than the table uses; bf16 cache [pages, 2, page_size, num_kv_heads,
    head_dim] on the GPU."""
    pages = -(-kv // page_size)
    indices = torch.randperm(batch * pages + spare, device="cuda").to(torch.int32)[: batch * pages]
    indptr = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * pages
    last = torch.full((batch,), kv - (pages - 1) * page_size, dtype=torch.int32, device="cuda")
    cache = torch.randn(batch * pages + spare, 2, page_size, num_kv_heads, head_dim, dtype=torch.bfloat16,
                        device="cuda")
    return indptr, indices, last, cache
