"""Speculative sampling (chain and tree) and the tree-draft attention mask.

The defining property is tested statistically: drafts are drawn from the draft distributions (a Markov
chain over a vocabulary of V=8, so that every position's draft and target rows depend on the previous
token, as with real models), and the emitted tokens must be distributed exactly as the target's:
  * the first emitted token ~ P1 (the target at the root);
  * each later emitted token, given the previous emitted token a (which was an accepted draft token),
    ~ Pnext[a].
Each is a chi-square goodness-of-fit test over N=20000 draws (one request per draw, fixed seeds) at
significance 1e-3, with the critical value from the Wilson-Hilferty approximation of the chi-square
quantile; cells of zero target probability must hold zero counts exactly.

The statistics run on the torch path (20000 requests through the Triton interpreter would take minutes);
the Triton kernel is tied to it by bitwise equality on the same seed.
"""
import math

import pytest
import torch

from serveattn.quantization import segment_packbits
from serveattn.sampling import chain_speculative_sampling, tree_speculative_sampling
from serveattn.spec_tree import tree_parents_to_mask

V = 8
N = 20000
ALPHA_Z = 3.090232  # the standard normal's upper 1e-3 quantile


def chi2_critical(df: int) -> float:
    """Upper 1e-3 quantile of chi-square(df), Wilson-Hilferty."""
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + ALPHA_Z * math.sqrt(h)) ** 3


def _dist(g, shape, support=None):
    x = torch.rand(*shape, generator=g) ** 2 + 1e-3
    if support is not None:
        mask = torch.zeros(V, dtype=torch.bool)
        mask[list(support)] = True
        x = x * mask
    return (x / x.sum(-1, keepdim=True)).float()


def _tables(kind: str, seed: int):
    """(Q1 [V], Qnext [V, V], P1 [V], Pnext [V, V]) for draft Q and target P."""
    g = torch.Generator().manual_seed(seed)
    if kind == "random":
        return _dist(g, (V,)), _dist(g, (V, V)), _dist(g, (V,)), _dist(g, (V, V))
    if kind == "disjoint":  # draft on 0..3, target on 4..7: every draft token is rejected
        lo, hi = range(0, 4), range(4, 8)
        return _dist(g, (V,), lo), _dist(g, (V, V), lo), _dist(g, (V,), hi), _dist(g, (V, V), hi)
    if kind == "overlap":  # draft on 0..5, target on 3..7
        a, b = range(0, 6), range(3, 8)
        return _dist(g, (V,), a), _dist(g, (V, V), a), _dist(g, (V,), b), _dist(g, (V, V), b)
    if kind == "equal":  # draft == target: everything is accepted
        q1, qn = _dist(g, (V,)), _dist(g, (V, V))
        return q1, qn, q1.clone(), qn.clone()
    raise AssertionError(kind)


def _chi2(counts: torch.Tensor, probs: torch.Tensor):
    """Pearson statistic and degrees of freedom of counts [V] against probs [V]; zero cells must be empty."""
    total = int(counts.sum())
    if total == 0:
        return 0.0, 0
    zero = probs <= 0
    assert int(counts[zero].sum()) == 0, f"tokens of zero target probability were emitted: {counts}, {probs}"
    exp = total * probs.double()[~zero]
    stat = float(((counts.double()[~zero] - exp) ** 2 / exp).sum())
    return stat, int((~zero).sum()) - 1


def _check_distribution(out: torch.Tensor, P1: torch.Tensor, Pn: torch.Tensor) -> None:
    stat, df = _chi2(torch.bincount(out[:, 0].long(), minlength=V), P1)
    assert stat < chi2_critical(df), f"first token: chi2={stat:.1f} df={df} crit={chi2_critical(df):.1f}"
    pairs = torch.zeros(V, V, dtype=torch.long)
    for d in range(out.shape[1] - 1):
        has = out[:, d + 1] >= 0
        a, b = out[has, d].long(), out[has, d + 1].long()
        pairs += torch.bincount(a * V + b, minlength=V * V).reshape(V, V)
    stat, df = 0.0, 0
    for a in range(V):
        s, f = _chi2(pairs[a], Pn[a])
        stat, df = stat + s, df + f
    if df:
        assert stat < chi2_critical(df), f"later tokens: chi2={stat:.1f} df={df} crit={chi2_critical(df):.1f}"


def _chain_inputs(kind: str, n: int, B: int, seed: int):
    Q1, Qn, P1, Pn = _tables(kind, seed)
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.empty(B, n, dtype=torch.long)
    ids[:, 0] = torch.multinomial(Q1.expand(B, V), 1, generator=g)[:, 0]
    for i in range(1, n):
        ids[:, i] = torch.multinomial(Qn[ids[:, i - 1]], 1, generator=g)[:, 0]
    draft = torch.empty(B, n, V)
    target = torch.empty(B, n + 1, V)
    draft[:, 0], target[:, 0] = Q1, P1
    draft[:, 1:] = Qn[ids[:, :-1]]
    target[:, 1:] = Pn[ids]
    return draft, ids.to(torch.int32), target, (Q1, Qn, P1, Pn)


def _check_layout(out, accepted, emitted, ids):
    """Accepted draft tokens, then one sampled token, then -1; accepted (independent tests) >= emitted."""
    n1 = out.shape[1]
    pos = torch.arange(n1)[None, :]
    e = emitted.long()[:, None]
    drafts = torch.cat([ids.to(torch.int32), torch.full_like(out[:, :1], -1)], dim=1)
    assert bool((out == drafts)[pos < e].all())
    assert bool((out.gather(1, e) >= 0).all())
    assert bool((out[(pos > e).expand_as(out)] == -1).all())
    assert bool((accepted >= emitted).all())


# ---------------------------------------------------------------- chain: the defining property

@pytest.mark.parametrize("kind", ["random", "disjoint", "overlap", "equal"])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_chain_emits_the_target_distribution(kind, n):
    draft, ids, target, (_, _, P1, Pn) = _chain_inputs(kind, n, N, seed=10 * n + len(kind))
    out, accepted, emitted = chain_speculative_sampling(draft, ids, target, seed=1234 + n, backend="torch")
    assert out.shape == (N, n + 1) and out.dtype == torch.int32
    assert accepted.dtype == torch.int32 and emitted.dtype == torch.int32
    _check_layout(out, accepted, emitted, ids)
    if kind == "disjoint":
        assert int(emitted.max()) == 0 and int(accepted.max()) == 0
    if kind == "equal":
        assert int(emitted.min()) == n
    _check_distribution(out, P1, Pn)


# ---------------------------------------------------------------- tree: the defining property

TREE = [-1, -1, -1, 0, 0, 1, 3, 6]  # root: 3 children; node 0: 2; node 1: 1; a chain 3 -> 6 -> 7


def _tree_inputs(kind: str, B: int, seed: int, parents=TREE):
    Q1, Qn, P1, Pn = _tables(kind, seed)
    T = len(parents)
    g = torch.Generator().manual_seed(seed + 7)
    ids = torch.empty(B, T, dtype=torch.long)
    draft = torch.empty(B, T, V)
    target = torch.empty(B, T + 1, V)
    target[:, 0] = P1
    for owner in [-1] + list(range(T)):
        kids = [t for t, p in enumerate(parents) if p == owner]
        if not kids:
            continue
        q = Q1.expand(B, V) if owner < 0 else Qn[ids[:, owner]]
        # siblings drawn without replacement, in index order (the documented convention)
        ids[:, kids] = torch.multinomial(q, len(kids), replacement=False, generator=g)
        draft[:, kids] = q[:, None, :]
        for k in kids:
            target[:, k + 1] = Pn[ids[:, k]]
    par = torch.tensor(parents, dtype=torch.int32).expand(B, T).contiguous()
    return draft, ids.to(torch.int32), target, par, (Q1, Qn, P1, Pn)


@pytest.mark.parametrize("kind", ["random", "disjoint", "overlap", "equal"])
def test_tree_emits_the_target_distribution(kind):
    draft, ids, target, par, (_, _, P1, Pn) = _tree_inputs(kind, N, seed=3 + len(kind))
    out, accepted, emitted, nodes = tree_speculative_sampling(draft, ids, target, par, seed=99,
                                                               return_accepted_nodes=True)
    T = par.shape[1]
    assert out.shape == (N, T + 1) and nodes.shape == (N, T)
    # the accepted nodes form a root path and their tokens are the emitted draft tokens
    for b in range(0, N, 997):
        e = int(emitted[b])
        path = nodes[b, :e].tolist()
        assert nodes[b, e:].eq(-1).all()
        prev = -1
        for node in path:
            assert TREE[node] == prev
            prev = node
        assert out[b, :e].tolist() == ids[b, path].tolist()
        assert int(out[b, e]) >= 0 and out[b, e + 1:].eq(-1).all()
    if kind == "disjoint":
        assert int(emitted.max()) == 0
    if kind == "equal":
        assert int(emitted.min()) >= 2  # the first child is always accepted
    _check_distribution(out, P1, Pn)


TREE2 = [-1, 0, 0, 0, 1, 1, 2, 4]  # one root child with 3 children; same size as TREE


def test_tree_with_shapes_that_differ_per_request():
    a = _tree_inputs("random", N // 2, seed=21, parents=TREE)
    b = _tree_inputs("random", N // 2, seed=21, parents=TREE2)  # same tables (same seed), other drafts
    draft, ids, target, par = (torch.cat([x, y]) for x, y in zip(a[:4], b[:4]))
    out, accepted, emitted, nodes = tree_speculative_sampling(draft, ids, target, par, seed=5,
                                                               return_accepted_nodes=True)
    _, _, P1, Pn = a[4]
    _check_distribution(out, P1, Pn)
    parents = par.long()
    for row in range(0, N, 211):  # the accepted nodes form a root path of that request's tree
        prev = -1
        for node in nodes[row, : int(emitted[row])].tolist():
            assert int(parents[row, node]) == prev
            prev = node


def test_tree_duplicate_siblings_are_rejected_not_nan():
    B, T = 4000, 3
    g = torch.Generator().manual_seed(4)
    q = _dist(g, (V,), range(0, 2))  # two tokens only, three siblings: a duplicate is certain
    p = _dist(g, (V,))
    draft = q.expand(B, T, V).contiguous()
    target = p.expand(B, T + 1, V).contiguous()
    ids = torch.multinomial(q.expand(B, V), T, replacement=True, generator=g).to(torch.int32)
    par = torch.full((B, T), -1, dtype=torch.int32)
    out, accepted, emitted, nodes = tree_speculative_sampling(draft, ids, target, par, seed=1,
                                                               return_accepted_nodes=True)
    assert bool(((out[:, 0] >= 0) & (out[:, 0] < V)).all())
    for row in range(B):
        if int(emitted[row]):
            node = int(nodes[row, 0])
            assert int(ids[row, node]) not in ids[row, :node].tolist()  # never a repeat of a rejected token


def test_tree_on_a_chain_is_the_chain_sampler():
    draft, ids, target, _ = _chain_inputs("random", 3, 2000, seed=5)
    par = torch.tensor([-1, 0, 1]).expand(2000, 3)
    chain = chain_speculative_sampling(draft, ids, target, seed=77)
    tree = tree_speculative_sampling(draft, ids, target, par, seed=77)
    for a, b in zip(chain, tree):
        assert torch.equal(a, b)


# ---------------------------------------------------------------- Triton == torch, determinism

def _random_case(B, n, V_, seed, disjoint=False):
    g = torch.Generator().manual_seed(seed)
    d = torch.rand(B, n, V_, generator=g) ** 3
    t = torch.rand(B, n + 1, V_, generator=g) ** 3
    if disjoint:
        d[..., V_ // 2:] = 0
        t[..., : V_ // 2] = 0
    d, t = d / d.sum(-1, keepdim=True), t / t.sum(-1, keepdim=True)
    ids = torch.multinomial(d.reshape(-1, V_), 1, generator=g).reshape(B, n).to(torch.int32)
    return d, ids, t


@pytest.mark.parametrize("B,n,V_,disjoint,id_dtype", [
    (96, 3, 37, False, torch.int32),
    (64, 1, 8, True, torch.int64),
    (32, 4, 300, False, torch.int64),
    (3, 2, 5000, False, torch.int32),  # several vocabulary blocks in the kernel
    (16, 0, 11, False, torch.int32),  # no draft token: one sample from the target
])
def test_triton_matches_torch_bitwise(B, n, V_, disjoint, id_dtype, device):
    d, ids, t = (x.to(device) for x in _random_case(B, n, V_, seed=B + n + V_, disjoint=disjoint))
    ids = ids.to(id_dtype)
    ref = chain_speculative_sampling(d, ids, t, seed=2024, backend="torch")
    got = chain_speculative_sampling(d, ids, t, seed=2024, backend="triton")
    for a, b in zip(ref, got):
        assert a.dtype == b.dtype and torch.equal(a, b)
    ref = [x.cpu() for x in ref]
    ids = ids.cpu()
    _check_layout(*ref, ids)


def test_deterministic_and_seeded():
    d, ids, t = _random_case(500, 3, 16, seed=1)
    a = chain_speculative_sampling(d, ids, t, seed=7)
    b = chain_speculative_sampling(d, ids, t, seed=7)
    c = chain_speculative_sampling(d, ids, t, generator=torch.Generator().manual_seed(11))
    e = chain_speculative_sampling(d, ids, t, generator=torch.Generator().manual_seed(11))
    f = chain_speculative_sampling(d, ids, t, seed=8)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert all(torch.equal(x, y) for x, y in zip(c, e))
    assert not torch.equal(a[0], f[0])
    par = torch.tensor([-1, -1, 0]).expand(500, 3)
    ta = tree_speculative_sampling(d, ids, t, par, seed=3)
    tb = tree_speculative_sampling(d, ids, t, par, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(ta, tb))


def test_triton_chain_sampling_is_deterministic(device):
    """The Triton kernel run twice on one seed (and on one generator state): the same bits, counters included."""
    d, ids, t = (x.to(device) for x in _random_case(12, 3, 37, seed=6))
    a, b = (chain_speculative_sampling(d, ids, t, seed=7, backend="triton") for _ in range(2))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    c, e = (chain_speculative_sampling(d, ids, t, generator=torch.Generator(device).manual_seed(11),
                                       backend="triton") for _ in range(2))
    assert all(torch.equal(x, y) for x, y in zip(c, e))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_draft_token_with_q_equal_to_p_is_always_accepted(backend):
    """u takes the draw's top 24 bits (exact in float32): u < 1 even for the largest draws, which as value * 2^-31
    rounded to 1.0 and rejected a token with q == p (acceptance probability 1). The generator is positioned on
    such a draw: 2147483633, past 2^31 - 64. The Triton kernel runs on CUDA where there is one (the interpreter
    on CPU); the draws come from the CPU generator either way."""
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    p = torch.full((4,), 0.25, device=device)
    g = torch.Generator().manual_seed(0)
    torch.randint(0, 1 << 31, (3270768,), dtype=torch.int64, generator=g)  # to the high draw
    peek = torch.Generator()
    peek.set_state(g.get_state())
    assert int(torch.randint(0, 1 << 31, (1,), dtype=torch.int64, generator=peek)) >= (1 << 31) - 64
    out, accepted, emitted = chain_speculative_sampling(p.expand(1, 1, 4).contiguous(),
                                                        torch.tensor([[2]], dtype=torch.int32, device=device),
                                                        p.expand(1, 2, 4).contiguous(), generator=g, backend=backend)
    assert out.device.type == device and accepted.tolist() == [1] and emitted.tolist() == [1] and out[0, 0] == 2


def test_seed_and_offset_pairs_name_streams_of_their_own():
    """(seed, offset) pairs are mixed, not added: (1, 0) and (0, 1_000_003) once drew the same numbers."""
    args = _chain_args()
    first, again = (chain_speculative_sampling(**args, seed=1, offset=0)[0] for _ in range(2))
    assert torch.equal(first, again)  # the same pair: the same stream
    from serveattn import sampling
    a = sampling._random_bits("t", (64,), "cpu", None, 1, 0)
    b = sampling._random_bits("t", (64,), "cpu", None, 0, 1_000_003)
    assert not torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_float_probabilities_are_read_as_float32(dtype):
    """FlashInfer casts 16-bit and float64 probabilities with .float(): the same draws give the float32 call's
    tokens and counts, on the chain and the tree."""
    d, ids, t = _random_case(6, 3, 16, seed=4)
    d, t = d.to(dtype), t.to(dtype)
    got = chain_speculative_sampling(d, ids, t, seed=7)
    want = chain_speculative_sampling(d.float(), ids, t.float(), seed=7)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    parents = torch.tensor([[-1, 0, 1]] * 6, dtype=torch.int32)
    got = tree_speculative_sampling(d, ids, t, parents, seed=7)
    want = tree_speculative_sampling(d.float(), ids, t.float(), parents, seed=7)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_counts_are_added_in_place():
    d, ids, t = _random_case(20, 3, 16, seed=2)
    out, acc, emi = chain_speculative_sampling(d, ids, t, seed=5)
    acc_buf = torch.full((20,), 10, dtype=torch.int32)
    emi_buf = torch.full((20,), 100, dtype=torch.int32)
    out2, acc2, emi2 = chain_speculative_sampling(d, ids, t, acc_buf, emi_buf, seed=5)
    assert acc2 is acc_buf and emi2 is emi_buf
    assert torch.equal(out, out2) and torch.equal(acc_buf, acc + 10) and torch.equal(emi_buf, emi + 100)


# ---------------------------------------------------------------- refusals

def _chain_args():
    d, ids, t = _random_case(4, 2, 8, seed=0)
    return dict(draft_probs=d, draft_token_ids=ids, target_probs=t)


@pytest.mark.parametrize("change,exc,match", [
    (lambda a: a.update(draft_probs=a["draft_probs"].to(torch.float8_e4m3fn)), NotImplementedError,
     r"draft_probs has dtype torch.float8_e4m3fn; probabilities are served in float32, float16, bfloat16 or float64"),
    (lambda a: a.update(target_probs=a["target_probs"].to(torch.int32)), ValueError,
     "target_probs has dtype torch.int32; probabilities must be floating point"),
    (lambda a: a.update(draft_probs=a["draft_probs"][0]), ValueError, "draft_probs has shape"),
    (lambda a: a.update(target_probs=a["target_probs"][:, :2]), ValueError, r"target_probs has shape .* expected"),
    (lambda a: a.update(draft_token_ids=a["draft_token_ids"].float()), ValueError, "int32 or int64"),
    (lambda a: a.update(draft_token_ids=a["draft_token_ids"][:, :1]), ValueError, "draft_token_ids has shape"),
    (lambda a: a.update(draft_token_ids=a["draft_token_ids"] + 8), ValueError, "outside the vocabulary"),
    (lambda a: a.update(backend="cuda"), ValueError, "backend='cuda'"),
    (lambda a: a.update(seed=1, generator=torch.Generator()), ValueError, "generator and seed"),
    (lambda a: a.update(offset=3, generator=torch.Generator()), ValueError,
     "generator and offset were both given; pass a generator, or a seed"),
    (lambda a: a.update(seed=1.5), ValueError, "seed=1.5"),
    (lambda a: a.update(deterministic="yes"), ValueError, "deterministic='yes'"),
    (lambda a: a.update(maybe_output_accepted_token_num=torch.zeros(4, dtype=torch.int64)), ValueError,
     "maybe_output_accepted_token_num has shape"),
    (lambda a: a.update(maybe_output_emitted_draft_token_num=torch.zeros(3, dtype=torch.int32)), ValueError,
     "maybe_output_emitted_draft_token_num has shape"),
    # numpy's seeding once answered these with its own sentence, naming neither the entry point nor the argument
    (lambda a: a.update(seed=-1), ValueError, r"^chain_speculative_sampling: seed=-1 is negative"),
    (lambda a: a.update(seed=1, offset=torch.tensor([-5])), ValueError,
     r"^chain_speculative_sampling: offset=-5 is negative"),
    # FlashInfer's per-request seeds (one per request) are valid there: not served, not called a wrong argument
    (lambda a: a.update(seed=torch.arange(4), offset=torch.zeros(4, dtype=torch.int64)), NotImplementedError,
     "seed holds 4 per-request values; one seed per call is served"),
    # torch's dispatcher errors (sparse, nested) and Tensor.item() on meta named no argument
    (lambda a: a.update(draft_probs=a["draft_probs"].to_sparse()), NotImplementedError,
     r"draft_probs is a sparse_coo tensor on cpu; dense \(strided\) tensors"),
    (lambda a: a.update(draft_token_ids=a["draft_token_ids"].to_sparse()), NotImplementedError,
     "draft_token_ids is a sparse_coo tensor"),
    (lambda a: a.update({k: v.to("meta") for k, v in a.items()}), NotImplementedError,
     "draft_probs is a strided tensor on meta; dense"),
])
def test_chain_refusals(change, exc, match):
    args = _chain_args()
    change(args)
    with pytest.raises(exc, match=match):
        chain_speculative_sampling(**args)


def test_tree_refusals():
    d, ids, t = _random_case(2, 3, 8, seed=0)
    good = torch.tensor([[-1, 0, 0], [-1, -1, 1]])
    with pytest.raises(ValueError, match=r"tree_parents\[0, 1\]=1"):
        tree_speculative_sampling(d, ids, t, torch.tensor([[-1, 1, 0], [-1, -1, 1]]))
    with pytest.raises(ValueError, match=r"tree_parents\[1, 0\]=-2; a parent must be -1 \(the root\) or nothing "
                                         r"else for node 0"):
        tree_speculative_sampling(d, ids, t, torch.tensor([[-1, 0, 0], [-2, -1, 1]]))
    with pytest.raises(ValueError, match="tree_parents has shape"):
        tree_speculative_sampling(d, ids, t, good[:, :2])
    with pytest.raises(ValueError, match="tree_parents has type"):
        tree_speculative_sampling(d, ids, t, good.float())
    with pytest.raises(ValueError, match="target_probs has shape"):
        tree_speculative_sampling(d, ids, t[:, :3], good)
    with pytest.raises(NotImplementedError, match="served in float32, float16, bfloat16 or float64"):
        tree_speculative_sampling(d.to(torch.float8_e5m2), ids, t, good)
    with pytest.raises(NotImplementedError, match="tree_parents is a sparse_coo tensor"):
        tree_speculative_sampling(d, ids, t, good.to_sparse())
    with pytest.raises(ValueError, match=r"^tree_speculative_sampling: seed=-7 is negative"):
        tree_speculative_sampling(d, ids, t, good, seed=-7)


# ---------------------------------------------------------------- the tree mask

def _brute_mask(parents, prefix):
    T = len(parents)
    rows = []
    for r in range(T):
        row = [True] * prefix + [False] * T
        a = r
        while a != -1:
            row[prefix + a] = True
            a = parents[a]
        rows.append(row)
    return [x for row in rows for x in row]


def test_tree_mask_matches_an_ancestor_walk():
    g = torch.Generator().manual_seed(0)
    parents_list, prefixes = [], []
    for T, pre in [(1, 0), (5, 3), (9, 17), (13, 1), (4, 0), (0, 5)]:
        parents_list.append([int(torch.randint(-1, t, (1,), generator=g)) if t else -1 for t in range(T)])
        prefixes.append(pre)
    mask, packed, indptr = tree_parents_to_mask(parents_list, prefixes)
    expect = [x for p, pre in zip(parents_list, prefixes) for x in _brute_mask(p, pre)]
    assert mask.dtype == torch.bool and mask.tolist() == expect
    sizes = [len(p) * (len(p) + pre) for p, pre in zip(parents_list, prefixes)]
    assert indptr.dtype == torch.int32 and indptr.tolist() == [0] + list(torch.tensor(sizes).cumsum(0).tolist())
    ref, _ = segment_packbits(mask, indptr, bitorder="little")
    assert torch.equal(packed, ref)
    # little-endian bits, each request's segment padded to whole bytes
    start = 0
    for i, size in enumerate(sizes):
        nbytes = (size + 7) // 8
        bits = [(int(packed[start + j // 8]) >> (j % 8)) & 1 for j in range(nbytes * 8)]
        seg = mask[indptr[i]:indptr[i + 1]].tolist()
        assert bits[:size] == [int(x) for x in seg] and not any(bits[size:])
        start += nbytes
    assert start == packed.numel()


def test_chain_tree_gives_the_bottom_right_causal_mask():
    for T, pre in [(4, 0), (5, 6), (1, 3)]:
        mask, _, _ = tree_parents_to_mask([list(range(-1, T - 1))], torch.tensor([pre]))
        kv = T + pre
        causal = torch.arange(kv)[None, :] <= (kv - T + torch.arange(T))[:, None]
        assert torch.equal(mask.reshape(T, kv), causal)


def test_tree_mask_refusals():
    with pytest.raises(ValueError, match=r"parents_list\[0\]\[1\]=1"):
        tree_parents_to_mask([[-1, 1]], [0])
    with pytest.raises(ValueError, match="prefix_lens has 2 entries for 1"):
        tree_parents_to_mask([[-1, 0]], [0, 1])
    with pytest.raises(ValueError, match=r"prefix_lens\[0\]=-2"):
        tree_parents_to_mask([[-1, 0]], [-2])
