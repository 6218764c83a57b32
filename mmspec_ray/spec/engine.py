"""Decoding engines. AREngine: the autoregressive baseline over the same target primitives SpecEngine uses."""

from __future__ import annotations

import time

import torch

from mmspec_ray.config import SamplingParams
from mmspec_ray.spec.output import Generation, GenerationStats, OutputTracker
from mmspec_ray.spec.sampling import make_generator, pick
from mmspec_ray.targets.base import Request, VLMTarget


class AREngine:
    """One token per target forward; every speedup is measured against this."""

    def __init__(self, target: VLMTarget) -> None:
        self.target = target

    @torch.inference_mode()
    def generate(self, request: Request, sampling: SamplingParams | None = None, max_new_tokens: int = 128,
                 stop: tuple[str, ...] = ()) -> Generation:
        sampling = sampling or SamplingParams()
        t = self.target
        t0 = time.perf_counter()
        inputs = t.encode(request)
        n_prompt = inputs["input_ids"].shape[1]
        t.check_length(n_prompt, max_new_tokens)
        gen = make_generator(sampling, t.device)
        tracker = OutputTracker(t.tokenizer, t.eos_token_ids, max_new_tokens, stop)
        stats = GenerationStats(prompt_tokens=n_prompt)
        out = t.prefill(inputs)
        stats.prefill_s = time.perf_counter() - t0
        token = pick(out.logits[0, -1], sampling, gen)
        one = torch.ones((1, 1), dtype=torch.bool)
        zero = torch.zeros(1, dtype=torch.long)
        while not tracker.add([token]):
            tv = time.perf_counter()
            out = t.verify(torch.tensor([token]), one, zero)
            t.commit([0])
            stats.verify_s += time.perf_counter() - tv
            stats.cycles += 1
            stats.accepted_per_cycle.append(0)
            token = pick(out.logits[0, -1], sampling, gen)
        stats.total_s = time.perf_counter() - t0
        stats.overhead_s = stats.total_s - stats.prefill_s - stats.verify_s
        return tracker.result(stats)
