"""The rejection sampler: exact on literal greedy cases, distribution-preserving when sampling.

The statistical tests sample the first emitted token(s) many times and compare the empirical
distribution with the target's ``p``. Bound: with N draws over V outcomes the expected total
variation distance is about sqrt(V / (2πN)) / 1 ≈ 0.008 for V=8, N=20k; we allow 0.03, and
also require a chi-square p-value above 1e-4 (fixed seeds, so the test is deterministic).
"""

import pytest
import torch
from scipy.stats import chisquare

from device_reads import reads
from specserve.replicas.rejection_sampler import greedy_choices, sampled_chain_verdicts, sampled_choices, verify
from specserve.replicas.sampling import SamplingParams, logits_to_probs
from specserve.replicas.step import Proposal

GREEDY = SamplingParams()
SAMPLE = SamplingParams(temperature=1.0)


def one_hot_logits(rows: list[int], vocab: int = 6) -> torch.Tensor:
    logits = torch.zeros(len(rows), vocab)
    logits[torch.arange(len(rows)), torch.tensor(rows)] = 5.0
    return logits


def point_mass_logits(rows: list[int], vocab: int = 6) -> torch.Tensor:
    """Rows that put all probability on one token even when sampling (exp(-inf) is exactly 0)."""
    logits = torch.full((len(rows), vocab), float("-inf"))
    logits[torch.arange(len(rows)), torch.tensor(rows)] = 0.0
    return logits


def test_greedy_chain_accepts_matching_prefix_then_bonus():
    # target argmaxes: 3, 4, 0, 2 ; draft proposes 3, 4, 1 -> accept 2, bonus = 0
    path, bonus = verify(one_hot_logits([3, 4, 0, 2]), Proposal.chain([3, 4, 1]), GREEDY)
    assert path == [0, 1] and bonus == 0


def test_greedy_chain_all_accepted_gets_bonus_from_last_row():
    path, bonus = verify(one_hot_logits([3, 4, 5]), Proposal.chain([3, 4]), GREEDY)
    assert path == [0, 1] and bonus == 5


def test_greedy_empty_proposal_is_plain_decoding():
    assert verify(one_hot_logits([2]), Proposal.empty(), GREEDY) == ([], 2)


def test_greedy_tree_follows_the_matching_branch():
    # root children: node0=1, node1=3; node1's child node2=4. Target: root->3, node1->4, node2->5
    proposal = Proposal(tokens=[1, 3, 4], parents=[-1, -1, 1])
    logits = one_hot_logits([3, 0, 4, 5])  # rows: root, node0, node1, node2
    assert verify(logits, proposal, GREEDY) == ([1, 2], 5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64],
                         ids=["float32 (C pass)", "bfloat16 (C pass)", "float64 (torch, as off the CPU)"])
def test_greedy_choices_are_each_rows_first_argmax_and_mark_rows_holding_nan(dtype):
    """Several requests' rows read at once: per tensor, each row's first largest index, as torch's
    argmax; a row holding NaN (anywhere, even below its largest value) is -1, its neighbours not."""
    generator = torch.Generator().manual_seed(0)
    big = torch.randn(7, 50, generator=generator)
    big[1, [4, 9]] = 10.0                  # a tie: the first one
    big[3, 20] = float("nan")              # NaN below the row's largest
    big[5] = float("-inf")                 # every value the same: index 0
    rows = [big[:2], big[2:5], big[5:], big[::2][:2]]   # views, one of them strided
    rows = [r.to(dtype) for r in rows]
    got = greedy_choices(rows)
    want = [[-1 if r[i].isnan().any() else int(r[i].argmax()) for i in range(len(r))] for r in rows]
    assert got == want and got[0][1] == 4 and got[1][1] == -1 and got[2][0] == 0
    assert greedy_choices([]) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a read from the device is seen on CUDA only")
def test_greedy_choices_wait_for_the_device_once_for_every_request():
    logits = torch.randn(20, 1000, device="cuda")
    logits[7, 3] = float("nan")
    rows = [logits[:5], logits[5:6], logits[6:14], logits[14:]]
    got, waits = reads(lambda: greedy_choices(rows), "cuda")
    assert waits == 1
    assert got == [[-1 if r[i].isnan().any() else int(r[i].argmax()) for i in range(len(r))] for r in rows]


@pytest.mark.parametrize("params", [SAMPLE, SamplingParams(temperature=0.7, top_k=3), SamplingParams(temperature=1.0, top_p=0.5),
                                    SamplingParams(temperature=1.0, min_p=0.1)], ids=["plain", "top-k", "top-p", "min-p"])
def test_sampled_choices_draw_each_row_within_its_warp_and_mark_rows_that_are_not_distributions(params):
    """Several requests' rows drawn at once: each token one the row's warp keeps; a row holding
    NaN or +inf, or all -inf, is -1, its neighbours drawn."""
    generator = torch.Generator().manual_seed(0)
    big = torch.randn(9, 40, generator=generator)
    big[2, 7] = float("nan")
    big[4, 1] = float("inf")
    big[6] = float("-inf")
    rows = [big[:3], big[3:5], big[5:], big[::2][:2]]   # views, one of them strided
    got = sampled_choices(rows, [params] * 4, [torch.Generator().manual_seed(i) for i in range(4)])
    for r, tokens, at in zip(rows, got, [[0, 1, 2], [3, 4], [5, 6, 7, 8], [0, 2]]):
        assert len(tokens) == len(r)
        for i, token in zip(at, tokens):
            if i in (2, 4, 6):
                assert token == -1
            else:
                assert logits_to_probs(big[i], params)[token] > 0
    assert sampled_choices([], [], []) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a read from the device is seen on CUDA only")
def test_sampled_choices_wait_for_the_device_once_for_every_request():
    logits = torch.randn(20, 1000, device="cuda")
    rows = [logits[:5], logits[5:6], logits[6:14], logits[14:]]
    generators = [torch.Generator(device="cuda").manual_seed(i) for i in range(4)]
    got, waits = reads(lambda: sampled_choices(rows, [SamplingParams(temperature=0.8, top_k=50)] * 4, generators), "cuda")
    assert waits == 1
    assert [len(tokens) for tokens in got] == [5, 1, 8, 6] and min(min(tokens) for tokens in got) >= 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a read from the device is seen on CUDA only")
def test_a_sampled_verify_waits_for_the_device_a_fixed_number_of_times_a_row_it_walks():
    """A sampled chain: one read of every position's u, p(x), q(x) and its rows' validity, and one
    of the bonus's draw, whatever the window and however many chains; a point-mass tree: the draw
    of each row on its accepted path (which checks the row)."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(6, 50, device="cuda")
    q = torch.softmax(torch.randn(5, 50, device="cuda"), -1)
    chain = Proposal.chain([int(t) for t in q.argmax(-1)], draft_probs=q)
    _, waits = reads(lambda: verify(logits, chain, SAMPLE, generator), "cuda")
    assert waits == 2
    # Several chains: still two reads for all of them.
    _, waits = reads(lambda: sampled_chain_verdicts([logits] * 4, [chain] * 4, [SAMPLE] * 4, [generator] * 4), "cuda")
    assert waits == 2
    tree = Proposal(tokens=[1, 2, 3, 4, 5], parents=[-1, -1, 0, 2, 3])
    rows = point_mass_logits([1, 3, 0, 4, 5, 2]).cuda()
    (path, _), waits = reads(lambda: verify(rows, tree, SAMPLE, generator), "cuda")
    assert path == [0, 2, 3, 4] and waits == len(path) + 1


@pytest.mark.parametrize("bad", ["nan", "+inf", "all -inf"])
@pytest.mark.parametrize("params", [SAMPLE, SamplingParams(temperature=0.7, top_k=3), SamplingParams(temperature=1.0, top_p=0.5),
                                    SamplingParams(temperature=1.0, min_p=0.1)], ids=["plain", "top-k", "top-p", "min-p"])
@pytest.mark.parametrize("beforehand", [False, True], ids=["drawn-on-arrival", "drawn-beforehand"])
def test_a_row_that_is_not_finite_is_refused_on_a_point_mass_path(bad, params, beforehand):
    """The walk warps without the warp's own check: the draw refuses what it would have."""
    from specserve.replicas.sampling import NonFiniteScores

    logits = torch.randn(3, 6, generator=torch.Generator().manual_seed(0))
    logits[0] = point_mass_logits([2])[0]   # the root surely accepts node 0 (token 2)
    if bad == "nan":
        logits[1, 4] = float("nan")
    elif bad == "+inf":
        logits[1, 4] = float("inf")
    else:
        logits[1] = float("-inf")
    generator = torch.Generator().manual_seed(1)
    choice = sampled_choices([logits], [params], [generator])[0] if beforehand else None
    with pytest.raises(NonFiniteScores):
        verify(logits, Proposal.chain([2, 5]), params, generator, choice=choice)


def test_sampled_chains_verified_together_are_each_verified_as_alone():
    """Each request draws from its own generator in its own order, so verifying chains together
    gives each the verdict it gets alone; a request whose rows are not finite fails alone."""
    from specserve.replicas.sampling import NonFiniteScores

    g = torch.Generator().manual_seed(0)
    params = [SAMPLE, SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=1.2, top_p=0.8), SAMPLE, SAMPLE]
    rows, proposals = [], []
    for window in (3, 1, 4, 2, 0):
        rows.append(torch.randn(window + 1, 12, generator=g))
        q = torch.softmax(torch.randn(window, 12, generator=g) * 3, -1)
        proposals.append(Proposal.chain([int(torch.multinomial(q[i], 1, generator=g)) for i in range(window)],
                                        draft_probs=q))
    rows[3][1, 5] = float("nan")

    def generators():
        return [torch.Generator().manual_seed(10 + i) for i in range(len(rows))]

    together = sampled_chain_verdicts(rows, proposals, params, generators())
    alone = []
    for r, proposal, prm, generator in zip(rows, proposals, params, generators()):
        try:
            alone.append(verify(r, proposal, prm, generator))
        except NonFiniteScores as err:
            alone.append(err)
    assert isinstance(together[3], NonFiniteScores) and isinstance(alone[3], NonFiniteScores)
    assert together[:3] + together[4:] == alone[:3] + alone[4:]
    assert {len(path) for path, _ in together[:3]} != {0}   # something was accepted somewhere
    assert sampled_chain_verdicts([], [], [], []) == []


def test_greedy_verify_with_choices_read_beforehand_follows_them():
    proposal = Proposal(tokens=[1, 3, 4], parents=[-1, -1, 1])
    logits = one_hot_logits([3, 0, 4, 5])
    assert verify(logits, proposal, GREEDY, choice=greedy_choices([logits])[0]) == ([1, 2], 5)
    # The rows given are the ones followed (the caller read them from these logits).
    assert verify(logits, proposal, GREEDY, choice=[1, 2, 0, 0]) == ([0], 2)
    with pytest.raises(Exception, match="not finite"):
        verify(logits, proposal, GREEDY, choice=[3, 0, -1, 5])


def test_sampled_chain_all_accepted_gets_bonus_from_the_row_after_the_last_token():
    # p is a point mass on each drafted token, so p(x) = 1 >= q(x) whatever q is: both tokens are
    # accepted for every u. The row after them (row 2 = len(proposal)) puts all its mass on 1,
    # which is neither drafted token, so reading any other row cannot give 1.
    q = torch.tensor([[0.1, 0.2, 0.1, 0.4, 0.1, 0.1], [0.3, 0.1, 0.1, 0.1, 0.3, 0.1]])
    proposal = Proposal.chain([3, 4], draft_probs=q)
    for seed in range(20):
        gen = torch.Generator().manual_seed(seed)
        assert verify(point_mass_logits([3, 4, 1]), proposal, SAMPLE, gen) == ([0, 1], 1)


def test_point_mass_chain_all_accepted_gets_bonus_from_the_row_after_the_last_token():
    # Sampling with a deterministic draft (no draft_probs): accept x with probability p(x) = 1.
    gen = torch.Generator().manual_seed(0)
    assert verify(point_mass_logits([3, 4, 1]), Proposal.chain([3, 4]), SAMPLE, gen) == ([0, 1], 1)


def test_point_mass_tree_all_accepted_gets_bonus_from_the_row_after_the_leaf():
    # root children: node0=1, node1=3; node1's child node2=4. The root row gives 1 probability 0
    # and 3 probability 1, node1's row gives 4 probability 1: path node1 -> node2 for every u.
    # The bonus comes from node2's row (row 3), a point mass on 5; node0's row (row 1), never
    # reached, points at 2 so that reading it would show.
    proposal = Proposal(tokens=[1, 3, 4], parents=[-1, -1, 1])
    logits = point_mass_logits([3, 2, 4, 5])
    gen = torch.Generator().manual_seed(0)
    assert verify(logits, proposal, SAMPLE, gen) == ([1, 2], 5)


def empirical(counts: torch.Tensor, p: torch.Tensor, n: int):
    tv = 0.5 * (counts / n - p).abs().sum().item()
    support = p > 0
    assert counts[~support].sum() == 0, "emitted a token the target gives probability 0"
    pvalue = chisquare(counts[support].numpy(), (p[support] * n).numpy()).pvalue
    return tv, pvalue


@pytest.fixture
def p_q():
    torch.manual_seed(0)   # Dirichlet.sample takes no generator
    p = torch.distributions.Dirichlet(torch.ones(8)).sample((2,))
    q = torch.distributions.Dirichlet(torch.ones(8) * 0.5).sample((1,))
    return p, q  # p: [2, 8] target rows (position 0 and bonus row), q: [1, 8]


def test_sampled_chain_preserves_target_distribution(p_q):
    p, q = p_q
    gen = torch.Generator().manual_seed(1)
    n = 20_000
    counts = torch.zeros(8)
    for _ in range(n):
        x = int(torch.multinomial(q[0], 1, generator=gen))
        path, bonus = verify(p.log(), Proposal.chain([x], draft_probs=q), SAMPLE, gen)
        counts[x if path else bonus] += 1
    tv, pvalue = empirical(counts, p[0], n)
    assert tv < 0.03 and pvalue > 1e-4, (tv, pvalue)


def test_sampled_chain_second_token_is_distributed_as_p():
    # Two-token chain: the second emitted token must follow p[1] whatever happened at the first.
    torch.manual_seed(2)
    gen = torch.Generator().manual_seed(2)
    p = torch.distributions.Dirichlet(torch.ones(4)).sample((3,))
    q = torch.distributions.Dirichlet(torch.ones(4)).sample((2,))
    n = 20_000
    counts = torch.zeros(4)
    for _ in range(n):
        xs = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(2)]
        path, bonus = verify(p.log(), Proposal.chain(xs, draft_probs=q), SAMPLE, gen)
        emitted = [xs[i] for i in path] + [bonus]
        if len(emitted) >= 2:
            counts[emitted[1]] += 1
    tv, pvalue = empirical(counts, p[1], int(counts.sum()))
    assert tv < 0.03 and pvalue > 1e-4, (tv, pvalue)


@pytest.mark.parametrize("beforehand", [False, True], ids=["drawn-on-arrival", "drawn-beforehand"])
@pytest.mark.parametrize("children", [[2], [2, 5, 0], [7, 3]])
def test_point_mass_tree_preserves_target_distribution(children, p_q, beforehand):
    p, _ = p_q
    p = p.clone()
    p[0, 7] = 0.0   # a candidate the target never emits must never be accepted
    p[0] /= p[0].sum()
    gen = torch.Generator().manual_seed(3)
    n = 20_000
    proposal = Proposal(tokens=children, parents=[-1] * len(children))
    logits = torch.cat([p[:1].log(), torch.zeros(len(children), 8)])
    counts = torch.zeros(8)
    for _ in range(n):
        choice = sampled_choices([logits], [SAMPLE], [gen])[0] if beforehand else None
        path, bonus = verify(logits, proposal, SAMPLE, gen, choice=choice)
        counts[children[path[0]] if path else bonus] += 1
    tv, pvalue = empirical(counts, p[0], n)
    assert tv < 0.03 and pvalue > 1e-4, (tv, pvalue)


@pytest.mark.parametrize("draft", ["sampled", "point mass"])
def test_bonus_after_a_fully_accepted_chain_is_distributed_as_the_next_row(p_q, draft):
    # Row 0 makes acceptance of the one drafted token certain: p = q for a sampled draft (accept
    # with min(1, p/q) = 1), p = δ_x for a point mass (accept with p(x) = 1). The bonus must then
    # follow row 1 = p[1]; row 0 (q or δ_x) is far from p[1], so sampling from it would fail.
    p, q = p_q
    x = 2
    gen = torch.Generator().manual_seed(4)
    if draft == "sampled":
        row0 = q[0].log()
    else:
        row0 = point_mass_logits([x], vocab=8)[0]
    logits = torch.stack([row0, p[1].log()])
    n = 20_000
    counts = torch.zeros(8)
    for _ in range(n):
        if draft == "sampled":
            x = int(torch.multinomial(q[0], 1, generator=gen))
            proposal = Proposal.chain([x], draft_probs=q)
        else:
            proposal = Proposal.chain([x])
        path, bonus = verify(logits, proposal, SAMPLE, gen)
        if path == [0]:
            counts[bonus] += 1
    # softmax(log q) can round a hair below q, so a rejection is possible in principle, not in fact.
    assert counts.sum() >= 0.999 * n
    tv, pvalue = empirical(counts, p[1], int(counts.sum()))
    assert tv < 0.03 and pvalue > 1e-4, (tv, pvalue)
