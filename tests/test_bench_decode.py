"""The decode benchmark's ragged cases on the CPU: case names, the seeded length draws, the page table and inputs,
the per-request reference against the float64 oracle, ours through the interpreter, and the peers that take one
length declining with a sentence."""
import os

import pytest
import torch

from serveattn import reference
from serveattn.bench import common, decode
from helpers import rel_err

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def test_case_names_and_lengths():
    assert decode.parse_case("64x8192") == (64, 8192) and decode.parse_case("128xlognormal") == (128, "lognormal")
    with pytest.raises(SystemExit, match="is not <batch>x<kv_len>.*lengths one of"):
        decode.parse_case("8xzipf")
    lens = decode.case_lengths("256xlognormal")
    assert len(lens) == 256 and max(lens) <= 32768 and min(lens) >= 1 and len(set(lens)) > 100
    assert lens == decode.case_lengths("256xlognormal")  # one draw a batch size
    outlier = decode.case_lengths("64xoutlier")
    assert sorted(outlier) == [1024] * 63 + [32768]
    assert all(1 <= n <= 8192 for n in decode.case_lengths("128xuniform"))
    assert decode.case_lengths("4x100") == [100] * 4
    args = type("Args", (), {"ragged": True, "cases": None, "peers": None, "ours": None, "quick": False})()
    names, _, _ = decode._selected(args)
    assert names == list(decode.RAGGED_WORKLOADS)


@pytest.mark.skipif(not INTERPRETED, reason="ours runs through Triton's interpreter: TRITON_INTERPRET=1")
def test_ragged_case_reference_ours_and_declines(monkeypatch):
    monkeypatch.setattr(decode, "DEVICE", "cpu")
    kv_lens = [5, 40, 1, 33]
    meta = decode.build_meta(len(kv_lens), max(kv_lens), seed=3, kv_lens=kv_lens)
    assert meta.kv_lens == kv_lens and meta.num_pages == 1 + 3 + 1 + 3
    assert sorted(meta.indices.tolist()) == list(range(meta.num_pages))
    s0 = decode.build_inputs(meta, seed=7)
    assert s0.kb is None and s0.vb is None
    ref, how = decode.reference(meta, s0)
    assert "per request" in how
    oracle = reference.batch_paged(s0.q, s0.cache, torch.arange(len(kv_lens) + 1, dtype=torch.int32),
                                   meta.indptr, meta.indices, meta.last_page_len, causal=False)[0]
    assert rel_err(ref, oracle) < 1e-2
    ours = decode.prepare_ours(False, False, meta, [s0])
    out = ours.poisoned()
    assert not out.isnan().any() and rel_err(out, oracle) < decode.TOL
    for prepare in (decode.PREPARE["flash"], decode.PREPARE["cudnn"], decode.PREPARE["flex"]):
        with pytest.raises(common.Declined, match="lengths differ"):
            prepare(meta, [s0])
