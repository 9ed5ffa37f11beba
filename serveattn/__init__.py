"""serveattn: attention kernels for LLM serving, with FlashInfer's API (see API.md in the project's docs)."""
from .cascade import MultiLevelCascadeAttentionWrapper, merge_state, merge_state_in_place, merge_states
from .decode import (
    BatchDecodeWithPagedKVCacheWrapper,
    CUDAGraphBatchDecodeWithPagedKVCacheWrapper,
    single_decode_with_kv_cache,
)
from .page import append_paged_kv_cache, get_batch_indices_positions, get_seq_lens
from .prefill import (
    BatchPrefillWithPagedKVCacheWrapper,
    BatchPrefillWithRaggedKVCacheWrapper,
    single_prefill_with_kv_cache,
    single_prefill_with_kv_cache_return_lse,
)
from .quantization import packbits, segment_packbits
from .sampling import chain_speculative_sampling, tree_speculative_sampling
from .spec_tree import tree_parents_to_mask

__version__ = "0.1.0"

__all__ = [
    "BatchDecodeWithPagedKVCacheWrapper",
    "CUDAGraphBatchDecodeWithPagedKVCacheWrapper",
    "MultiLevelCascadeAttentionWrapper",
    "merge_state",
    "merge_state_in_place",
    "merge_states",
    "single_decode_with_kv_cache",
    "BatchPrefillWithPagedKVCacheWrapper",
    "BatchPrefillWithRaggedKVCacheWrapper",
    "append_paged_kv_cache",
    "chain_speculative_sampling",
    "get_batch_indices_positions",
    "get_seq_lens",
    "packbits",
    "segment_packbits",
    "single_prefill_with_kv_cache",
    "single_prefill_with_kv_cache_return_lse",
    "tree_parents_to_mask",
    "tree_speculative_sampling",
]
