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


def chunked_prefill(ws, batch: int, rows: int, kv: int, page_size: int, heads: tuple, **plan_kwargs):
    """(wrapper, q, cache): the paged prefill wrapper (backend "triton") planned for batch requests of `rows` new
    tokens over kv keys each (causal: chunked prefill), shuffled pages; heads = (query heads, KV heads, head dim)."""
    import serveattn
    num_qo_heads, num_kv_heads, head_dim = heads
    indptr, indices, last, cache = shuffled_pages(batch, kv, page_size, num_kv_heads, head_dim)
    qo = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * rows
    q = torch.randn(batch * rows, num_qo_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    w = serveattn.BatchPrefillWithPagedKVCacheWrapper(ws, backend="triton")
    w.plan(qo, indptr, indices, last, num_qo_heads, num_kv_heads, head_dim, page_size, causal=True,
           q_data_type=torch.bfloat16, **plan_kwargs)
    return w, q, cache
