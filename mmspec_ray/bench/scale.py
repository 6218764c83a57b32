"""Engine costs at real scale on a tiny model with a real vocabulary: one decoding cycle (draft, verify, accept,
commit) at several context lengths, and the peak memory of a long prefill with and without full-prompt logits.

The model is a random-init 2-layer LLaVA (hidden 64) with a 152,064-token vocabulary (Qwen2's), so every cost that
scales with the vocabulary or the context shows, and the transformer itself costs little. Text-only prompts of
random ids; the drafter is an untrained EAGLE-2 head (the default tree: top-k 8, depth 5, 48 tokens); each cycle
commits the path to the tree's deepest node (a non-chain commit, the expensive kind).
`nice python -m mmspec_ray.bench.scale` (docs/engine.md records its output)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from types import SimpleNamespace

import torch

from mmspec_ray.config import SamplingParams
from mmspec_ray.drafters.base import target_features
from mmspec_ray.drafters.eagle import Eagle2Drafter
from mmspec_ray.decoding.accept import accept
from mmspec_ray.decoding.sampling import make_generator
from mmspec_ray.decoding.tree import DraftTree, TreeConfig
from mmspec_ray.targets.base import VLMTarget

VOCAB = 152_064


def scale_target(vocab: int = VOCAB, max_context: int = 8192) -> VLMTarget:
    """A random-init tiny LLaVA with a `vocab`-token head, wrapped by the generic adapter (no processor needed:
    this benchmark feeds token ids straight to prefill)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    text = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_context,
                       tie_word_embeddings=False)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                              image_size=32, patch_size=8)
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(LlavaConfig(text_config=text, vision_config=vision,
                                                      image_token_index=vocab - 1))
    return VLMTarget(model.eval(), SimpleNamespace(tokenizer=SimpleNamespace(eos_token_id=None)))


def prompt(n: int, vocab: int = VOCAB) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab - 2, (1, n), generator=torch.Generator().manual_seed(n))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def deepest_path(tree: DraftTree) -> list[int]:
    """Node indices from the root to the tree's deepest node."""
    node, par = int(tree.depth.argmax()), tree.parents.tolist()
    path = [node]
    while par[path[-1]] >= 0:
        path.append(par[path[-1]])
    return path[::-1]


def copy_commit(target: VLMTarget, keep: list[int]) -> None:
    """The commit this engine had before: index_select of the whole cache (context + kept nodes) per layer."""
    L = target.seq_len
    idx = torch.cat([torch.arange(L), L + torch.tensor(keep)])
    for layer in target.cache.layers:
        layer.keys, layer.values = layer.keys.index_select(-2, idx), layer.values.index_select(-2, idx)
    target.seq_len, target.next_pos = L + len(keep), target.next_pos + len(keep)


STAGES = ("draft", "verify", "accept_greedy", "accept_sampling", "commit")


class CycleBench:
    """One request's decoding state at a given context length, stepped one cycle at a time (its own target wrapper
    and cache around a shared model, so several contexts can be stepped in turn and share the machine's noise)."""

    @torch.inference_mode()
    def __init__(self, target: VLMTarget, context: int, old_commit: bool = False) -> None:
        self.target = VLMTarget(target.model, target.processor)
        out = self.target.prefill(prompt(context, target.vocab_size))
        self.root = int(out.logits[0, -1].argmax())
        self.drafter = Eagle2Drafter.random(self.target)
        self.drafter.begin(self.target, out, self.root)
        self.old_commit = old_commit
        self.cfg, self.greedy = TreeConfig(), SamplingParams()
        self.hot = SamplingParams(temperature=1.0, top_p=0.9, seed=0)
        self.gen = make_generator(self.hot, self.target.device)

    @torch.inference_mode()
    def step(self) -> dict[str, float]:
        """Milliseconds of each stage of one cycle (draft includes the drafter's observe)."""
        t, d = self.target, self.drafter
        t0 = time.perf_counter()
        tree = d.propose(self.root, self.cfg)
        t1 = time.perf_counter()
        v = t.verify(tree.tokens, tree.ancestors, tree.depth)
        t2 = time.perf_counter()
        accept(tree, v.logits[0], self.greedy, self.gen)
        t3 = time.perf_counter()
        accept(tree, v.logits[0], self.hot, self.gen)
        t4 = time.perf_counter()
        path = deepest_path(tree)
        copy_commit(t, path) if self.old_commit else t.commit(path)
        t5 = time.perf_counter()
        self.root = int(v.logits[0, path[-1]].argmax())
        d.observe(tree.tokens[path].tolist(), target_features(d, v)[0, path], self.root)
        t6 = time.perf_counter()
        return dict(zip(STAGES, (1e3 * x for x in (t1 - t0 + t6 - t5, t2 - t1, t3 - t2, t4 - t3, t5 - t4))))


def cycle_costs(target: VLMTarget, contexts: tuple[int, ...], cycles: int = 9, warmup: int = 2,
                old_commit: bool = False) -> dict[int, dict[str, float]]:
    """{context: median ms per stage}, the contexts' cycles interleaved (round-robin) so load hits all alike."""
    benches = {n: CycleBench(target, n, old_commit) for n in contexts}
    rec: dict[int, list[dict[str, float]]] = {n: [] for n in contexts}
    for _ in range(cycles):
        for n, b in benches.items():
            rec[n].append(b.step())
    return {n: {k: statistics.median(r[k] for r in rs[warmup:]) for k in STAGES} for n, rs in rec.items()}


def prefill_peak_mb(context: int, logits_to_keep: int) -> tuple[float, float]:
    """(peak resident memory of a fresh interpreter that loads the model and runs one `context`-token prefill,
    the part of it above the loaded model's baseline), in MB."""
    code = ("import resource, torch; torch.set_num_threads(1); from mmspec_ray.bench import scale as s; "
            "t = s.scale_target(); t.prefill(s.prompt(8)); "
            "b = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss; "
            f"t.prefill(s.prompt({context}), logits_to_keep={logits_to_keep}); "
            "p = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss; print(p / 1024, (p - b) / 1024)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    peak, added = res.stdout.strip().splitlines()[-1].split()
    return float(peak), float(added)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", default="256,1024,4096")
    p.add_argument("--cycles", type=int, default=9)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--memory-context", type=int, default=4096)
    p.add_argument("--out", default=None, help="also write the figures as JSON here")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    target = scale_target()
    res: dict = {"vocab": VOCAB, "threads": a.threads}
    print(f"one cycle, ms (median of {a.cycles - 2}), vocab {VOCAB}, {a.threads} thread(s)")
    print("| context | draft | verify | accept greedy | accept T=1 top-p 0.9 | commit | "
          "commit (old: whole-cache copy) |")
    print("|---|---|---|---|---|---|---|")
    contexts = tuple(int(x) for x in a.contexts.split(","))
    res["cycle_ms"] = cycle_costs(target, contexts, a.cycles)
    old = cycle_costs(target, contexts, a.cycles, old_commit=True)
    res["old_commit_ms"] = {n: c["commit"] for n, c in old.items()}
    for n, c in res["cycle_ms"].items():
        print(f"| {n} | {c['draft']:.2f} | {c['verify']:.2f} | {c['accept_greedy']:.2f} | "
              f"{c['accept_sampling']:.2f} | {c['commit']:.3f} | {res['old_commit_ms'][n]:.3f} |")
    m = a.memory_context
    res["prefill_peak_mb"] = {"all_logits": prefill_peak_mb(m, 0), "last_logits": prefill_peak_mb(m, 1)}
    for name, (peak, added) in res["prefill_peak_mb"].items():
        print(f"{m}-token prefill, {name.replace('_', ' ')}: peak RSS {peak:.0f} MB, {added:.0f} MB above the "
              "loaded model")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
