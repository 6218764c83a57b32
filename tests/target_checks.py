"""Family-independent checks of the target contract; every family's test module calls these."""

from __future__ import annotations

import numpy as np
import torch

from mmspec_ray.decoding.engine import AREngine
from mmspec_ray.targets.base import Request, VLMTarget

LOGIT_TOL = 1e-4  # float32: tree-masked vs per-path runs differ only by summation order (~1e-6 seen)


def random_tree(n: int, rng: np.random.Generator, vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens [n], parents [n] (-1 for the root), ancestors [n, n] bool, depth [n]; parents precede children."""
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
    anc = torch.zeros((n, n), dtype=torch.bool)
    depth = torch.zeros(n, dtype=torch.long)
    for i in range(n):
        anc[i, i] = True
        if parents[i] >= 0:
            anc[i] |= anc[parents[i]]
            depth[i] = depth[parents[i]] + 1
    tokens = torch.tensor(rng.integers(5, vocab, size=n))
    return tokens, torch.tensor(parents), anc, depth


def path_to(i: int, parents: torch.Tensor) -> list[int]:
    out = [i]
    while parents[out[-1]] >= 0:
        out.append(int(parents[out[-1]]))
    return out[::-1]


def check_verify_matches_paths(target: VLMTarget, request: Request, n: int = 12, seed: int = 0) -> float:
    """verify(tree) logits/hidden == running each root-to-leaf path alone as a causal continuation."""
    rng = np.random.default_rng(seed)
    inputs = target.encode(request)
    tokens, parents, anc, depth = random_tree(n, rng, min(target.vocab_size, 250))
    target.prefill(inputs)
    tree = target.verify(tokens, anc, depth)
    worst = 0.0
    leaves = [i for i in range(n) if i not in set(parents.tolist())]
    for leaf in leaves:
        path = path_to(leaf, parents)
        target.prefill(inputs)
        chain = torch.ones((len(path), len(path)), dtype=torch.bool).tril()
        ref = target.verify(tokens[path], chain, torch.arange(len(path)))
        for a, b in ((tree.logits[0, path], ref.logits[0]), (tree.hidden[0, path], ref.hidden[0])):
            worst = max(worst, float((a.float() - b.float()).abs().max()))
    assert worst < LOGIT_TOL, f"tree vs path max abs diff {worst}"
    return worst


def check_commit_then_continue(target: VLMTarget, request: Request, steps: int = 12, seed: int = 0) -> None:
    """Commit a path out of a bushy tree, then continue greedily: same tokens as an uninterrupted greedy run."""
    ref = AREngine(target).generate(request, max_new_tokens=steps + 8).token_ids
    assert len(ref) >= steps + 2, "reference ended early; use a prompt that does not hit eos"
    inputs = target.encode(request)
    out = target.prefill(inputs)
    rng = np.random.default_rng(seed)
    produced = [int(out.logits[0, -1].argmax())]
    while len(produced) < steps:
        k = int(rng.integers(1, 4))  # true continuation length in this tree
        true = ref[len(produced) - 1: len(produced) - 1 + k + 1]  # root (already produced) + k true tokens
        # tree: the true chain, plus a random sibling branch under every chain node
        tokens, parents = [true[0]], [-1]
        chain_idx = [0]
        for tok in true[1:]:
            parents.append(chain_idx[-1]); tokens.append(tok); chain_idx.append(len(tokens) - 1)
        for c in list(chain_idx):
            parents.append(c); tokens.append(int(rng.integers(5, 200)))
        n = len(tokens)
        order = rng.permutation(np.arange(1, n))  # shuffle node order, keeping parents first
        pos = {0: 0}
        new_tokens, new_parents = [tokens[0]], [-1]
        for old in sorted(order, key=lambda o: _depth(o, parents)):
            pos[int(old)] = len(new_tokens)
            new_tokens.append(tokens[old]); new_parents.append(pos[parents[old]])
        anc = torch.zeros((n, n), dtype=torch.bool); depth = torch.zeros(n, dtype=torch.long)
        for i in range(n):
            anc[i, i] = True
            if new_parents[i] >= 0:
                anc[i] |= anc[new_parents[i]]; depth[i] = depth[new_parents[i]] + 1
        v = target.verify(torch.tensor(new_tokens), anc, depth)
        keep = [pos[c] for c in chain_idx]
        target.commit(keep)
        produced += true[1:] + [int(v.logits[0, keep[-1]].argmax())]
        # the bonus token must equal the reference's next token
    assert produced[:steps] == ref[:steps], (produced[:steps], ref[:steps])


def _depth(i: int, parents: list[int]) -> int:
    d = 0
    while parents[i] >= 0:
        i, d = parents[i], d + 1
    return d


def check_ar_equals_hf(target: VLMTarget, request: Request, max_new_tokens: int = 32) -> list[int]:
    """AREngine greedy == HF generate(do_sample=False), token for token; outputs are varied."""
    ours = AREngine(target).generate(request, max_new_tokens=max_new_tokens).token_ids
    inputs = target.encode(request)
    with torch.inference_mode():
        hf = target.model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens)
    hf_ids = hf[0, inputs["input_ids"].shape[1]:].tolist()
    assert ours == hf_ids, (ours, hf_ids)
    return ours
