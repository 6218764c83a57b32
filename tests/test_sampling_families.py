"""Sampling is distribution-preserving on every target family: 3-token sampled answers through the engine (a drafter
that proposes the target's own top-3, so drafts are accepted and rejected) against the exact warped target
distribution, by a chi-square test at p = 1e-4 (tests/test_engine.py has the same test on the tiny LLaVA)."""

from __future__ import annotations

from collections import Counter

import pytest

from mmspec_ray.config import SamplingParams
from mmspec_ray.decoding.engine import SpecEngine
from mmspec_ray.decoding.tree import TreeConfig
from mmspec_ray.targets import Request, wrap
from families import FAMILIES
from test_accept import chi2_critical, chi2_stat
from test_engine import PeekDrafter, target_three_token_distribution

SAMPLES = 1200


@pytest.mark.parametrize("family", list(FAMILIES))
def test_sampling_output_distribution_equals_the_target_on_every_family(family):
    target = wrap(*FAMILIES[family].builder(init=0.08))  # flatter logits: several tokens per step carry real mass
    params = SamplingParams(temperature=0.8, top_k=4, top_p=0.9)
    req = Request(prompt="describe the image")
    probs = target_three_token_distribution(target, req, params)
    assert len(probs) >= 8, (family, len(probs))  # the test distribution is not degenerate
    eng = SpecEngine(target, PeekDrafter(target), TreeConfig(top_k=3, depth=1, total_tokens=4))
    samples, accepted = Counter(), 0
    for s in range(SAMPLES):
        g = eng.generate(req, SamplingParams(temperature=0.8, top_k=4, top_p=0.9, seed=s), max_new_tokens=3)
        samples[tuple(g.token_ids)] += 1
        accepted += sum(g.stats.accepted_per_cycle)
    assert accepted > SAMPLES // 4, family  # drafts were really accepted (not a degenerate all-reject run)
    stat, df = chi2_stat(samples, probs, SAMPLES)
    assert stat < chi2_critical(df), f"{family}: chi2 {stat:.1f} > {chi2_critical(df):.1f} (df {df})"
