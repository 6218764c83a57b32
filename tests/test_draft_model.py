"""The draft-model drafter: a smaller sibling of the target (same tokenizer and processor) drafts a dynamic tree with
its own KV cache. Greedy output equals AR and HF generate on every family and request; a drafter that is the target
itself has its proposals accepted (positions, masks and KV reuse wired right); sampled output follows the target's
distribution; mismatched pairings and bad paths are refused by name; a saved sibling loads by path."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from mmspec_ray.drafters.base import load_drafter
from mmspec_ray.drafters.draft_model import DraftModelDrafter, is_draft_model_checkpoint
from mmspec_ray.decoding.engine import AREngine, SpecEngine
from mmspec_ray.decoding.tree import TreeConfig, ancestor_mask, depths
from mmspec_ray.targets import TargetError, wrap
from families import FAMILIES, build_target
from test_engine import SAMPLED_FLOOR, TREE, check_greedy_lossless, check_trained_drafter_samples
from test_payoff import ShuffledGuard

# where a family's tiny builder takes a layer count, the sibling has fewer layers than the target (2)
FEWER_LAYERS = {"llava": {"layers": 1}, "llava_onevision": {"num_hidden_layers": 1},
                "qwen3_vl": {"num_hidden_layers": 1}, "qwen3_vl_moe": {"num_hidden_layers": 1},
                "internvl": {"num_hidden_layers": 1}, "mistral3": {"num_hidden_layers": 1},
                "glm4v": {"num_hidden_layers": 1}, "glm4v_moe": {"num_hidden_layers": 1}}
CHAIN = TreeConfig(top_k=1, depth=6, total_tokens=8)  # a drafter that is the target: every node is accepted


def sibling(family: str, target, seed: int = 1) -> DraftModelDrafter:
    """A draft model for `target`: the family's tiny model with another seed (and fewer layers where the builder
    takes a count), sharing the target's processor (so its tokenizer)."""
    model, _ = FAMILIES[family].builder(seed=seed, **FEWER_LAYERS.get(family, {}))
    return DraftModelDrafter.from_model(model, target.processor, target)


def itself(target) -> DraftModelDrafter:
    """A draft model with the target's own weights (a copy, with its own cache)."""
    return DraftModelDrafter.from_model(copy.deepcopy(target.model), target.processor, target)


class CheckedDraftModel(DraftModelDrafter):
    """Asserts after every cycle that the draft's cache plus its pending tokens hold exactly what the target has
    committed, plus the next root; counts the nodes whose KV was reused."""

    reused = 0

    def observe(self, tokens, hidden, bonus):
        before = self.draft.seq_len
        super().observe(tokens, hidden, bonus)
        self.reused += self.draft.seq_len - before
        assert self.draft.seq_len + len(self.pending) == self.target.seq_len + 1
        assert self.draft.cache.get_seq_length() == self.draft.seq_len  # the cycle's other nodes are gone


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_equals_ar_and_hf_on_every_family(family):
    """Every request of the family (text, image, two images, video where it takes one): HF generate == AR == spec
    with a sibling draft model, and with the target's own weights as draft model (proposals accepted)."""
    torch.manual_seed(0)
    target = build_target(family)
    drafters = {"sibling": sibling(family, target), "itself": itself(target)}
    accepted = check_greedy_lossless(target, FAMILIES[family].requests, lambda: drafters.items(), family,
                                     max_new_tokens=24)
    assert accepted > 0, family


@pytest.mark.parametrize("family", ["llava", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "internvl", "mistral3",
                                    "glm4v", "glm4v_moe"])
def test_the_target_as_its_own_draft_model_is_accepted(family):
    """Greedy proposals of the target's own weights are the target's argmax: a chain is accepted whole every cycle,
    and a bushy tree accepts several tokens per cycle; after each cycle the accepted nodes' KV is kept (reused),
    and the draft holds exactly the committed context. A wrongly wired drafter (positions, masks, KV) would still
    be lossless, but not accepted."""
    target = build_target(family)
    req = FAMILIES[family].requests["image"]
    ar = AREngine(target).generate(req, max_new_tokens=32)
    d = CheckedDraftModel(wrap(copy.deepcopy(target.model), target.processor), target)
    g = SpecEngine(target, d, CHAIN).generate(req, max_new_tokens=32)
    assert g.token_ids == ar.token_ids
    assert g.stats.accepted_per_cycle[:-1] == [CHAIN.depth + 1] * (g.stats.cycles - 1), g.stats.accepted_per_cycle
    assert d.reused == CHAIN.depth * (g.stats.cycles - 1)  # every expanded accepted node kept its KV
    emitted = [1 + sum(a + 1 for a in g.stats.accepted_per_cycle[:i]) for i in range(g.stats.cycles)]
    depths = [max(1, min(CHAIN.depth, 32 - e - 2)) for e in emitted]  # the engine cuts the depth the answer can use
    assert d.passes == sum(depth + 1 for depth in depths), (d.passes, depths)
    tree = SpecEngine(target, d, TREE).generate(req, max_new_tokens=32)
    assert tree.token_ids == ar.token_ids
    assert min(tree.stats.accepted_per_cycle[:-1]) >= 1 and tree.stats.cycles * 3 <= len(ar.token_ids), \
        tree.stats.accepted_per_cycle
    assert d.reused > CHAIN.depth * (g.stats.cycles - 1)
    assert d.prefill_tokens == target.encode(req)["input_ids"].shape[1]


@pytest.mark.parametrize("family", ["llava", "qwen2_5_vl", "qwen3_vl_moe"])
def test_plain_stretches_between_drafted_cycles(family):
    """Under a guard that picks each cycle's tree at random (plain one-token steps included, the drafter begun
    late), the drafter hears of several cycles' tokens at once: output unchanged, the draft's context exact, and the
    accepted nodes it expanded still keep their KV."""
    target = build_target(family)
    req = FAMILIES[family].requests["image"]
    ar = AREngine(target).generate(req, max_new_tokens=40).token_ids
    for seed in range(2):
        d = CheckedDraftModel(wrap(copy.deepcopy(target.model), target.processor), target)
        g = SpecEngine(target, d, TREE, guard=ShuffledGuard(seed)).generate(req, max_new_tokens=40)
        assert g.token_ids == ar, seed
        assert 0 < g.stats.plain_cycles < g.stats.cycles and d.reused > 0, (seed, g.stats.plain_cycles, d.reused)
        s = SpecEngine(target, sibling(family, target), TREE, guard=ShuffledGuard(seed)).generate(
            req, max_new_tokens=40)
        assert s.token_ids == ar, seed


@pytest.mark.parametrize("family", ["gemma3", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v", "glm4v_moe"])
def test_a_tree_grown_level_by_level_scores_as_one_verify(family):
    """The generalised verify: a tree verified level by level after its root is committed (each level attending to
    the earlier levels left in the cache) gives the logits of verifying it at once; on Gemma3 through a sliding
    window shorter than the tree's context, on Qwen2.5-VL and Qwen3-VL (dense and MoE) with M-RoPE positions."""
    target = build_target(family)
    inputs = target.encode(FAMILIES[family].requests["image"])
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3, 5, 6])
    tokens = torch.tensor([17, 42, 99, 120, 7, 64, 31, 200, 150])
    anc, depth = ancestor_mask(parents), depths(parents)
    target.prefill(inputs)
    whole = target.verify(tokens, anc, depth).logits[0]
    target.prefill(inputs)
    target.verify(tokens[:1], anc[:1, :1], depth[:1])
    target.commit([0])
    rows = []
    for lv in range(1, int(depth.max()) + 1):
        new = torch.nonzero(depth == lv).flatten()
        seen = torch.arange(1, int(new.max()) + 1)  # this level and the ones before, root excluded
        out = target.verify(tokens[new], anc[new][:, seen], depth[new] - 1, cached_depth=depth[1:int(new.min())] - 1)
        rows.append(out.logits[0])
    worst = float((torch.cat(rows) - whole[1:]).abs().max())
    assert worst < 1e-4, worst
    with pytest.raises(RuntimeError, match="uncommitted nodes"):  # earlier nodes in the cache but no columns
        target.verify(tokens[:1], anc[:1, :1], depth[:1])


def test_sampled_answers_follow_the_target_distribution():
    """3-token answers sampled with the draft-model drafter (the target's weights: drafts are often accepted) follow
    the exact warped target distribution (chi-square at p = 1e-4 over 1,500 samples)."""
    from tiny import tiny_llava

    target = wrap(*tiny_llava(init=0.08))  # flatter logits: several tokens per step carry real mass
    check_trained_drafter_samples(target, itself(target), FAMILIES["llava"].requests["image"], SAMPLED_FLOOR)


@pytest.fixture(scope="module")
def llava():
    return build_target("llava")


def test_pairings_that_cannot_draft_are_refused(llava):
    other_family, _ = FAMILIES["qwen2_5_vl"].builder()
    with pytest.raises(TargetError, match="draft model is a qwen2_5_vl model .* the target a llava model"):
        DraftModelDrafter.from_model(other_family, FAMILIES["qwen2_5_vl"].builder()[1], llava)
    model, _ = FAMILIES["llava"].builder(seed=1, layers=1)
    processor = copy.deepcopy(llava.processor)
    processor.tokenizer.add_tokens(["<extra-token>"])
    with pytest.raises(TargetError, match="tokenizer differs .* 1 only in the draft's, e.g. '<extra-token>'"):
        DraftModelDrafter.from_model(model, processor, llava)
    processor = copy.deepcopy(llava.processor)
    processor.image_processor.image_mean = [0.5, 0.5, 0.5]
    with pytest.raises(TargetError, match="processes media unlike the target .*image_processor.image_mean"):
        DraftModelDrafter.from_model(model, processor, llava)


def test_bad_paths_are_refused(llava, tmp_path):
    with pytest.raises(TargetError, match="draft model .*/nowhere: checkpoint .* does not exist.*draft-model:PATH"):
        load_drafter(f"draft-model:{tmp_path}/nowhere", llava)
    with pytest.raises(ValueError, match="names no checkpoint"):
        load_drafter("draft-model:", llava)
    qwen, _ = FAMILIES["qwen2_5_vl"].builder()
    qwen.save_pretrained(tmp_path / "qwen")  # refused from its config, before any weights are read
    with pytest.raises(TargetError, match="a qwen2_5_vl model .* the target a llava model"):
        load_drafter(f"draft-model:{tmp_path}/qwen", llava)


def test_a_saved_sibling_loads_by_path(llava, tmp_path):
    """save_pretrained model + processor: `draft-model:PATH` and the bare PATH both load it (on the target's device
    and dtype), and it decodes AR's answer. A drafter head whose config names a VLM model type (released MSD heads
    do) is not taken for a draft model: it ships no processor."""
    model, processor = FAMILIES["llava"].builder(seed=1, layers=1)
    model.save_pretrained(tmp_path / "sib")
    processor.save_pretrained(tmp_path / "sib")
    req = FAMILIES["llava"].requests["two_images"]
    ar = AREngine(llava).generate(req, max_new_tokens=16)
    for spec in (f"draft-model:{tmp_path}/sib", str(tmp_path / "sib")):
        d = load_drafter(spec, llava)
        assert isinstance(d, DraftModelDrafter) and d.draft.checkpoint == str(tmp_path / "sib")
        assert d.draft.text_config.num_hidden_layers == 1 and d.draft.dtype == llava.dtype
        assert SpecEngine(llava, d, TREE).generate(req, max_new_tokens=16).token_ids == ar.token_ids
    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text(json.dumps({"model_type": "llava", "hidden_size": 64}))
    assert is_draft_model_checkpoint(str(tmp_path / "sib")) and not is_draft_model_checkpoint(str(head))


def test_padding_rows_of_the_draft_head_are_never_proposed(llava):
    """A draft whose LM head has more (padding) rows than the target's proposes only ids both know."""
    model, _ = FAMILIES["llava"].builder(seed=1, layers=1)
    model.resize_token_embeddings(llava.vocab_size + 16)
    with torch.no_grad():
        model.get_output_embeddings().weight[llava.vocab_size:] = 5.0  # padding rows that would win every argmax
    d = DraftModelDrafter.from_model(model, llava.processor, llava)
    assert d.vocab == llava.vocab_size and d.draft.vocab_size == llava.vocab_size + 16
    proposed: list[int] = []
    propose = d.propose
    d.propose = lambda root, cfg: proposed.extend((tree := propose(root, cfg)).tokens.tolist()) or tree
    req = FAMILIES["llava"].requests["image"]
    g = SpecEngine(llava, d, TREE).generate(req, max_new_tokens=16)
    assert g.token_ids == AREngine(llava).generate(req, max_new_tokens=16).token_ids
    assert proposed and max(proposed) < llava.vocab_size
