"""LANTERN's relaxed acceptance: the codebook's nearest codes, the relaxed mass p̃(x), each rule
against its definition (greedy: the argmax once x holds p̃(x); point masses: the relaxed
distribution, checked by chi-square), and a relaxed request through the image engine, named in
its summary."""

import pytest
import torch
from scipy.stats import chisquare

from specserve.replicas.image_engine import GENERATOR_DRAFT, ImageEngine
from specserve.replicas.lantern import Lantern, LatentRelaxation, latent_neighbours
from specserve.replicas.rejection_sampler import verify
from specserve.replicas.request import SpecRequest
from specserve.replicas.sampling import SamplingParams
from specserve.replicas.step import Proposal, TreeShape
from tiny_models import tiny_generator_draft, tiny_generator_folder

# Six codes on a line: each code's nearest are its neighbours on the line.
LINE = torch.tensor([[0.0], [1.0], [2.1], [3.3], [4.6], [6.0]])


def test_neighbours_are_the_other_codes_nearest_first_a_chunk_at_a_time():
    near = latent_neighbours(LINE)
    assert near.shape == (6, 5) and near.dtype == torch.int32
    assert near[0].tolist() == [1, 2, 3, 4, 5]
    assert near[2].tolist()[:2] == [1, 3] and near[5].tolist()[0] == 4
    assert torch.equal(latent_neighbours(LINE, chunk=2), near)
    assert latent_neighbours(LINE, k=2).shape == (6, 2)
    codes = torch.nn.functional.normalize(torch.randn(40, 8), dim=-1)
    near = latent_neighbours(codes, chunk=7)
    assert not (near == torch.arange(40)[:, None]).any()        # never itself
    first = torch.cdist(codes, codes).fill_diagonal_(9).argmin(-1)
    assert torch.equal(near[:, 0].long(), first)


def verify_relaxed(rows, proposal, params, generator, near, lantern):
    return verify(rows, proposal, params, generator, LatentRelaxation(near, lantern))


def logits(p: list[float]) -> torch.Tensor:
    return torch.tensor(p).log()[None].repeat(3, 1)   # the root's row and a row per node (two at most)


def test_greedy_follows_a_draft_whose_neighbours_carry_it_past_the_argmax():
    # Code 0 is the argmax (0.4); code 2 holds 0.25 and its nearest codes 1 and 3 hold 0.2 + 0.15.
    rows = logits([0.4, 0.2, 0.25, 0.15, 0.0, 0.0])
    near = latent_neighbours(LINE)
    drafted = Proposal.chain([2])
    assert verify(rows, drafted, SamplingParams()) == ([], 0)                      # exact: rejected
    # δ 0.4 takes code 1 (0.2) then code 3 (0.35 in all): p̃(2) = 0.6 > 0.4.
    assert verify_relaxed(rows, drafted, SamplingParams(), None, near, Lantern(0.4, 4)) == ([0], 0)
    # δ 0.1 takes none: p̃(2) = 0.25; k 1 with δ 0.25 takes code 1 alone: 0.45 > 0.4.
    assert verify_relaxed(rows, drafted, SamplingParams(), None, near, Lantern(0.1, 4)) == ([], 0)
    assert verify_relaxed(rows, drafted, SamplingParams(), None, near, Lantern(0.25, 1)) == ([0], 0)
    # The argmax itself is always followed, as under the exact rule.
    assert verify_relaxed(rows, Proposal.chain([0]), SamplingParams(), None, near, Lantern(0.1, 4)) == ([0], 0)


def test_a_token_outside_the_codebook_has_no_neighbours():
    rows = logits([0.3, 0.2, 0.25, 0.15, 0.05, 0.05])
    near = latent_neighbours(LINE[:4])                       # a codebook of 4: ids 4 and 5 are not codes
    assert verify_relaxed(rows, Proposal.chain([5]), SamplingParams(), None, near, Lantern(0.9, 3)) == ([], 0)


@pytest.mark.parametrize("drafted, want", [
    ([2], [0.1, 0.0, 0.6, 0.0, 0.2, 0.1]),
    # Code 2 rejected leaves p' = (0.25, 0, 0, 0, 0.5, 0.25); code 4 then takes its nearest, 3
    # (nothing left) and 5 (0.25): p̃'(4) = 0.75 of the 0.4 left.
    ([2, 4], [0.1, 0.0, 0.6, 0.0, 0.3, 0.0]),
], ids=["one-child", "two-children"])
def test_point_masses_emit_the_relaxed_distribution(drafted, want):
    # One step from the root: the emitted token's law is p with A(x)'s mass moved onto x (x tried
    # first), then the same for the next child against what is left.
    p = [0.1, 0.2, 0.25, 0.15, 0.2, 0.1]
    rows = logits(p)
    near = latent_neighbours(LINE)
    lantern = Lantern(0.4, 2)          # A(2) = {1, 3}: 0.2, then 0.35 in all
    proposal = Proposal(drafted, [-1] * len(drafted))
    generator = torch.Generator().manual_seed(0)
    draws = 20000
    counts = torch.zeros(6)
    for _ in range(draws):
        path, bonus = verify_relaxed(rows, proposal, SamplingParams(temperature=1.0), generator, near, lantern)
        counts[drafted[path[0]] if path else bonus] += 1
    want = torch.tensor(want)
    kept = want > 0
    assert (counts[~kept] == 0).all()
    assert chisquare(counts[kept].numpy(), (want[kept] * draws).numpy()).pvalue > 1e-3


def test_a_sampled_chain_accepts_against_the_relaxed_mass():
    rows = logits([0.1, 0.2, 0.25, 0.15, 0.2, 0.1])
    near = latent_neighbours(LINE)
    q = torch.zeros(2, 6)
    q[0, 2] = 0.8
    q[0, 0] = 0.2
    proposal = Proposal([2], [-1], draft_probs=q[:1])
    generator = torch.Generator().manual_seed(1)
    accepted = sum(verify_relaxed(rows, proposal, SamplingParams(temperature=1.0), generator, near,
                                  Lantern(0.4, 2))[0] == [0] for _ in range(4000))
    assert abs(accepted / 4000 - 0.6 / 0.8) < 0.03          # p̃(2) / q(2); exact: 0.25 / 0.8


def test_settings_are_checked():
    with pytest.raises(ValueError, match="delta"):
        Lantern(1.0, 4)
    with pytest.raises(ValueError, match="k must"):
        Lantern(0.4, 0)
    with pytest.raises(ValueError, match="image generator"):
        SpecRequest([1], 4, lantern=Lantern())                 # text has no grid


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    folder = tiny_generator_folder(tmp_path_factory.mktemp("models"), grid=4)
    return ImageEngine(folder, tiny_generator_draft(folder, noise=0.6), slots=8)


def test_a_relaxed_picture_request_says_so_and_accepts_no_less(engine):
    def run(lantern):
        requests = [engine.request(label, f"{label}-{lantern}", GENERATOR_DRAFT, tree=TreeShape(3, 2, 6),
                                   temperature=0.0, lantern=lantern) for label in range(6)]
        return engine.generate(requests)

    exact, relaxed = run(None), run(Lantern(0.5, 8))
    assert all(len(g.token_ids) == engine.settings.tokens for g in relaxed)
    assert all("acceptance" not in g.stats.summary() for g in exact)
    assert all(g.stats.summary()["acceptance"] == {"rule": "lantern", "delta": 0.5, "k": 8} for g in relaxed)
    per_step = [sum(g.stats.emitted for g in gens) / sum(g.stats.steps for g in gens) for gens in (exact, relaxed)]
    assert per_step[1] >= per_step[0]
    assert engine.pictures(relaxed)[0].size == (16, 16)
