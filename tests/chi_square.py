"""The goodness-of-fit test the distribution tests share."""

import torch
from scipy.stats import chisquare


def chi_square_pvalue(counts: torch.Tensor, joint: torch.Tensor) -> float:
    """p-value of observed ``counts`` against the exact distribution ``joint`` (same shape).

    Cells expected fewer than 5 times are pooled into one (the chi-square approximation needs
    it); a sample in a cell of probability 0 fails outright, whatever the p-value would say."""
    expected = joint.flatten().double() * counts.sum().item()
    observed = counts.flatten().double()
    assert observed[expected == 0].sum() == 0, "sampled a pair the target gives probability 0"
    big = expected >= 5
    f_obs, f_exp = [observed[big]], [expected[big]]
    if expected[~big].sum() > 0:
        f_obs.append(observed[~big].sum()[None])
        f_exp.append(expected[~big].sum()[None])
    f_obs, f_exp = torch.cat(f_obs), torch.cat(f_exp)
    f_exp *= f_obs.sum() / f_exp.sum()
    return float(chisquare(f_obs.numpy(), f_exp.numpy()).pvalue)
