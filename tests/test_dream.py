"""DREAM: the target's attention probe matches eager attention on every family; visual token compression
keeps exactly the configured share of visual tokens, the most-attended ones; entropy-adaptive layer selection picks
the lowest-entropy layer; the cross-attention respects the tree; training lowers the loss and resumes; a briefly
trained DREAM drafter stays lossless on every family and request, and its samples follow the target's distribution."""

from __future__ import annotations

import json

import pytest
import torch

from mmspec_ray.drafters.base import load_drafter
from mmspec_ray.drafters.dream import DreamDrafter, DreamHead, compress_visual
from mmspec_ray.decoding.engine import AREngine, SpecEngine
from mmspec_ray.decoding.tree import TreeConfig
from mmspec_ray.targets import Request, wrap
from mmspec_ray.targets.attention import LayerAttention, reduce_attention
from mmspec_ray.training.datagen import DatagenRecipe, generate_features, load_features, refeaturize
from mmspec_ray.training.dream import entropy_candidates, intermediate_features, select_layers
from mmspec_ray.training.methods import training_method
from mmspec_ray.training.trainer import TrainConfig, train_drafter
from families import FAMILIES, build_target
from test_engine import check_greedy_lossless, check_learned, with_cfg
from tiny import random_images, tiny_llava

TREE = TreeConfig(top_k=4, depth=4, total_tokens=20)


def eager_attention(target, inputs) -> tuple[torch.Tensor, ...]:
    """Every decoder layer's attention probabilities [H, n, n] from the model run eagerly (the reference)."""
    impl = target.model.config.get_text_config()._attn_implementation
    target.model.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            out = target.model(**inputs, output_attentions=True)
    finally:
        target.model.set_attn_implementation(impl)
    return tuple(a[0].float() for a in out.attentions[-target.text_config.num_hidden_layers:])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_prefill_attention_equals_the_eager_attention_of_every_family(family):
    """attention_received = the last layer's eager attention averaged over heads and text rows; attention_entropy =
    each row's entropy; the forward's own output unchanged."""
    target = build_target(family)
    req = FAMILIES[family].requests["two_images"]
    inputs = target.encode(req)
    L = target.text_config.num_hidden_layers
    plain = target.prefill(inputs)
    out = target.prefill(inputs, attention=True, entropy_layers=(0, L - 1))
    assert torch.equal(out.hidden, plain.hidden) and torch.equal(out.logits, plain.logits)
    att = eager_attention(target, inputs)
    text = (~out.media_mask[0]).float()
    want = (att[-1].mean(0) * (text / text.sum())[:, None]).sum(0)
    torch.testing.assert_close(out.attention_received[0], want, atol=1e-5, rtol=1e-4)
    for i in (0, L - 1):
        ent = -(att[i] * torch.log(att[i] + 1e-8)).sum(-1).mean(0)
        torch.testing.assert_close(out.attention_entropy[i][0], ent, atol=1e-4, rtol=1e-4)
        assert torch.equal(out.layers[i + 1], target.model(**inputs, output_hidden_states=True).hidden_states[i + 1])


def test_compression_keeps_the_exact_share_of_the_most_attended_visual_tokens():
    media = torch.tensor([0, 1, 1, 1, 1, 0, 1, 1, 1, 1, 0, 0], dtype=torch.bool)  # two images of 4 tokens
    scores = torch.tensor([9, .1, .8, .3, .5, 9, .7, .2, .9, .4, 9, 9])
    for keep, n in ((1.0, 8), (0.75, 6), (0.5, 4), (0.25, 2), (0.01, 1)):
        kept = compress_visual(media, scores, keep)
        assert bool(kept[~media].all()) and int(kept[media].sum()) == n == max(1, round(keep * 8))
        assert scores[kept & media].min() > scores[~kept & media].max() if n < 8 else True
    assert compress_visual(media, scores, 0.5).nonzero().flatten().tolist() == [0, 2, 4, 5, 6, 8, 10, 11]
    assert compress_visual(torch.zeros(3, dtype=torch.bool), torch.zeros(3), 0.5).all()


@pytest.mark.parametrize("family,request_name", [(f, r) for f, fam in FAMILIES.items() for r in fam.requests
                                                 if r in ("two_images", "video")])
def test_the_draft_stream_holds_the_kept_share_chosen_by_the_target_attention(family, request_name):
    """Several images and video frames: the stream is every text token + round(0.75 v) visual tokens, those the
    target's last layer attends most; the memory keeps every target feature."""
    target = build_target(family)
    d = DreamDrafter.random(target, seed=1)
    assert d.prefill_attention
    inputs = target.encode(FAMILIES[family].requests[request_name])
    pre = target.prefill(inputs, attention=True)
    media, score = pre.media_mask[0], pre.attention_received[0]
    d.begin(target, pre, root=5)
    v, n = int(media.sum()), media.shape[0]
    assert v > 0 and d.prefill_tokens == (n - v) + round(0.75 * v) + 1 and d.mem_len == n + 1
    kept = d.kept_positions(pre)
    assert scores_split(score, media, kept)
    d.head.cfg = d.head.cfg.model_copy(update={"vtc_keep": 1.0})
    d.begin(target, target.prefill(inputs), root=5)
    assert d.prefill_tokens == n + 1


def scores_split(score: torch.Tensor, media: torch.Tensor, kept: torch.Tensor) -> bool:
    """Every kept visual token is attended at least as much as every dropped one."""
    return bool(score[media & kept].min() >= score[media & ~kept].max())


def test_layer_selection_picks_the_lowest_entropy_layer():
    """Constructed attention: layer 2 is peaked on rows 0-1, layer 3 on rows 2-3, layer 1 is uniform; the
    selection follows the lowest entropy per row and returns that layer's output."""
    n = 4
    uniform = torch.full((1, 2, n, n), 1.0 / n)
    peaked = torch.full((1, 2, n, n), 0.01)
    peaked[..., torch.arange(n), torch.arange(n)] = 1 - 0.01 * (n - 1)
    l2 = uniform.clone(); l2[:, :, :2] = peaked[:, :, :2]
    l3 = uniform.clone(); l3[:, :, 2:] = peaked[:, :, 2:]
    ent = {i: reduce_attention(LayerAttention(probs=p))[1] for i, p in ((1, uniform), (2, l2), (3, l3))}
    assert torch.allclose(ent[1], torch.full((n,), torch.log(torch.tensor(float(n)))), atol=1e-5)
    assert select_layers(torch.stack([ent[i] for i in (1, 2, 3)]), (1, 2, 3)).tolist() == [2, 2, 3, 3]
    outs = {i: torch.full((n, 3), float(i)) for i in (1, 2, 3)}
    mid, chosen = intermediate_features(ent, outs)
    assert chosen.tolist() == [2, 2, 3, 3] and mid[:, 0].tolist() == [2.0, 2.0, 3.0, 3.0]
    assert entropy_candidates(32) == tuple(range(1, 11))  # the authors' window for a 32-layer target
    assert entropy_candidates(24) == tuple(range(1, 8)) and entropy_candidates(2) == (1,)


def test_cross_attention_sees_only_the_ancestors_features():
    """Changing the draft feature of one tree branch changes nothing in another branch: the tree mask holds inside
    the cross-attention (a node's memory = target features + the root's and its ancestors' draft features)."""
    target = wrap(*tiny_llava(init=0.3))
    d = DreamDrafter.random(target, seed=4)
    req = Request(prompt="describe the image", images=tuple(random_images(1, seed=4)))
    d.begin(target, target.prefill(target.encode(req), attention=True), root=5)
    seen = []
    hook = d.head.cross.register_forward_hook(lambda mod, args, out: seen.append(args[3].clone()))
    try:
        d.propose(5, TreeConfig(top_k=2, depth=3, total_tokens=8))
    finally:
        hook.remove()
    M = d.mem_len
    first, second = seen[0][0, 0], seen[1][0, 0]  # level 1 (two children of the root), level 2 (their children)
    assert first.shape[1] == M + 1 and first.all()  # committed features + the root's draft feature
    assert second.shape[1] == M + 3 and second[:, :M + 1].all()
    assert second[:, M + 1:].sum(1).tolist() == [1, 1]  # each level-2 node sees exactly one level-1 feature


@pytest.mark.parametrize("gate_init", [0.0, 1.0])
def test_closed_gates_give_the_cross_attention_no_gradient(gate_init):
    """At the authors' gate 0 the cross-attention's projections get exactly zero gradient (why the block stays
    unused in short training); with `gate_init` open they learn. The config carries gate_init into the head."""
    from mmspec_ray.drafters.dream import DreamConfig
    from mmspec_ray.training.dream import dream_loss

    target = wrap(*tiny_llava(init=0.3))
    torch.manual_seed(0)
    head = DreamHead(DreamConfig.for_target(target).model_copy(update={"gate_init": gate_init})).float()
    assert head.cross.attn_gate.item() == head.cross.mlp_gate.item() == gate_init
    B, T, d = 2, 6, target.hidden_size
    batch = {"emb": torch.randn(B, T, d), "mem": torch.randn(B, T, d), "tgt": torch.randn(B, T, d),
             "mid": torch.randn(B, T, d), "loss_mask": torch.ones(B, T, dtype=torch.bool),
             "valid": torch.ones(B, T, dtype=torch.bool)}
    dream_loss(head, batch, target.model.get_output_embeddings().weight.detach().float())[0].backward()
    grads = [head.cross.q_proj.weight.grad, head.cross.k_proj.weight.grad, head.cross.v_proj.weight.grad,
             head.cross.o_proj.weight.grad, head.cross.up_proj.weight.grad]
    if gate_init == 0.0:
        assert all(float(g.abs().max()) == 0.0 for g in grads)
    else:
        assert all(float(g.abs().max()) > 0.0 for g in grads)
    assert float(head.cross.attn_gate.grad.abs()) > 0.0  # the gate itself moves, with no consistent sign
    assert float(head.block1.q_proj.weight.grad.abs().max()) > 0.0  # the rest of the head trains either way


def _features(target, reqs, path, n_tokens=16, mid=True):
    return load_features(generate_features(target, reqs, DatagenRecipe(max_new_tokens=n_tokens, mid_features=mid),
                                           path))


def test_features_carry_the_selected_intermediate_layer_output(tmp_path):
    target = wrap(*tiny_llava(init=0.3))
    req = Request(prompt="describe the image", images=tuple(random_images(1, seed=1)))
    ex = _features(target, [req], tmp_path / "f", n_tokens=6)[0]
    assert ex.mid is not None and ex.mid.shape == ex.hidden.shape
    ids = ex.input_ids[None]
    inputs = target.encode(req)
    inputs["input_ids"] = ids
    inputs["attention_mask"] = torch.ones_like(ids)
    with torch.inference_mode():
        hs = target.model(**inputs, output_hidden_states=True).hidden_states
    torch.testing.assert_close(ex.mid.float(), hs[2][0].float(), atol=2e-3, rtol=2e-3)  # only candidate: layer 1
    plain = _features(target, [req], tmp_path / "p", n_tokens=6, mid=False)[0]
    again = load_features(refeaturize(target, [req], tmp_path / "p", DatagenRecipe(mid_features=True), tmp_path / "r"))
    assert torch.equal(again[0].input_ids, plain.input_ids) and torch.equal(again[0].mid, ex.mid)
    other = Request(prompt="what is there", images=req.images)
    with pytest.raises(ValueError, match="prompt ids differ"):
        refeaturize(target, [other], tmp_path / "p", DatagenRecipe(mid_features=True), tmp_path / "x")
    with pytest.raises(ValueError, match=r"dream training needs \['mid'\]"):
        train_drafter("dream", target, _features(target, [req], tmp_path / "g", 4, mid=False), tmp_path / "d",
                      TrainConfig(epochs=1))


def test_training_reads_the_draft_stream_the_drafter_reads_under_compression(tmp_path):
    """VTC in training: features store the prompt's last-layer attention from the engine's own prefill; with noise
    0 the training forward's final features at every answer entry equal the drafter's after begin + observe on
    the same sequence (vtc_keep 0.5: the same kept prompt positions, stream positions and memory visibility)."""
    from mmspec_ray.targets.base import TargetOutput
    from mmspec_ray.training.dream import dream_forward

    target = wrap(*tiny_llava(init=0.3))
    req = Request(prompt="describe the image", images=tuple(random_images(1, seed=3)))
    ex = load_features(generate_features(target, [req], DatagenRecipe(max_new_tokens=8, mid_features=True,
                                                                       dtype="float32"), tmp_path / "f"))[0]
    n0, n = ex.n_prompt, ex.input_ids.shape[0]
    pre = target.prefill(target.encode(req), attention=True)
    assert ex.received is not None and torch.equal(ex.received, pre.attention_received[0].float().cpu())
    d = DreamDrafter.random(target, seed=3)
    d.head.cfg = d.head.cfg.model_copy(update={"vtc_keep": 0.5})
    m = training_method("dream")
    batch = m.collate([ex], [0], 0.0, torch.Generator())
    with torch.no_grad():
        s, out, _ = dream_forward(d.head, batch)
    v = int(ex.media.sum())
    assert v > 1 and int(s["valid"].sum()) == n - v + round(0.5 * v)  # the stream is cut
    at = {int(p): j for j, p in enumerate(s["orig"][0].tolist()) if bool(s["valid"][0, j])}
    prompt = TargetOutput(logits=pre.logits, hidden=ex.hidden[None, :n0], input_ids=ex.input_ids[None, :n0],
                          inputs_embeds=ex.embeds[None, :n0], media_mask=ex.media[None, :n0],
                          attention_received=ex.received[None])
    ans = ex.input_ids[n0:].tolist()
    d.begin(target, prompt, root=ans[0])
    assert sorted(at)[:d.prefill_tokens] == d.kept_positions(prompt).nonzero().flatten().tolist() + [n0]
    for t in range(len(ans)):
        if t:
            d.observe([ans[t - 1]], ex.hidden[n0 + t - 1:n0 + t], bonus=ans[t])
        torch.testing.assert_close(d.last[0], out[0, at[n0 + t]], atol=1e-4, rtol=1e-4)


def test_the_intermediate_loss_supervises_block_1_by_default():
    """The paper's tap (E^1, the initial block's output) is the default; the authors' cross-attention block output
    is the `intermed_tap` option, and a misspelt option is refused."""
    from mmspec_ray.drafters.dream import DreamConfig
    from mmspec_ray.training.dream import dream_loss
    from mmspec_ray.training.methods import DreamMethod

    target = wrap(*tiny_llava(init=0.3))
    W = target.model.get_output_embeddings().weight.detach().float()
    assert DreamConfig.for_target(target).intermed_tap == "block1"
    torch.manual_seed(0)
    B, T, d = 2, 6, target.hidden_size
    batch = {"emb": torch.randn(B, T, d), "mem": torch.randn(B, T, d), "tgt": torch.randn(B, T, d),
             "mid": torch.zeros(B, T, d), "loss_mask": torch.ones(B, T, dtype=torch.bool),
             "valid": torch.ones(B, T, dtype=torch.bool)}
    for tap in ("block1", "ca_block"):
        head = DreamMethod(intermed_tap=None if tap == "block1" else tap).head(target).float()
        assert head.cfg.intermed_tap == tap
        with torch.no_grad():
            k, v = head.cross.memory(batch["mem"])
            cross = torch.ones(T, T, dtype=torch.bool).tril()[None, None].expand(B, 1, T, T)
            _, e1, f = head(batch["emb"], torch.arange(T)[None].expand(B, -1),
                            torch.ones(T, T, dtype=torch.bool).tril()[None, None].expand(B, 1, T, T), k, v, cross)
            batch["mid"] = e1 if tap == "block1" else f
            assert dream_loss(head, batch, W)[1]["midloss"] < 1e-6
    with pytest.raises(ValueError, match="intermed_tap 'block2'"):
        DreamMethod(intermed_tap="block2")


def test_old_features_without_attention_train_uncompressed_with_a_warning(tmp_path, caplog):
    """Features stored before `received` existed: the batch keeps every visual token, and a warning says so once."""
    import dataclasses
    import logging

    from mmspec_ray.training.dream import draft_stream

    target = wrap(*tiny_llava(init=0.3))
    reqs = [Request(prompt="describe the image", images=tuple(random_images(1, seed=i))) for i in range(2)]
    new = _features(target, reqs, tmp_path / "f", n_tokens=4)
    old = [dataclasses.replace(ex, received=None) for ex in new]
    m = training_method("dream")
    with caplog.at_level(logging.WARNING):
        m.check(old)
        batch = m.collate(old, [0, 1], 0.0, torch.Generator())
    assert sum("stored without the prompt's last-layer attention" in r.message for r in caplog.records) == 1
    assert torch.equal(draft_stream(batch, 0.75)["valid"], batch["valid"])
    cut = draft_stream(m.collate(new, [0, 1], 0.0, torch.Generator()), 0.75)["valid"]
    assert int(cut.sum()) < int(batch["valid"].sum())


def test_dream_training_lowers_the_loss_resumes_and_stays_lossless(tmp_path):
    target = wrap(*tiny_llava(init=0.3))
    mm = _features(target, [Request(prompt="describe the image", images=tuple(random_images(1, seed=i)))
                            for i in range(12)], tmp_path / "mm")
    cfg = TrainConfig(epochs=2, batch_size=4, lr=3e-3, warmup_steps=2, eval_max_new_tokens=8)
    heldout = [Request(prompt="describe the image", images=tuple(random_images(1, seed=100)))]
    out = train_drafter("dream", target, mm, tmp_path / "d", cfg, heldout=heldout)
    out = train_drafter("dream", target, mm, tmp_path / "d", cfg.model_copy(update={"epochs": 4}), heldout=heldout)
    hist = json.loads((out / "history.json").read_text())
    assert [h["epoch"] for h in hist] == [1, 2, 3, 4] and all(h["midloss"] > 0 for h in hist)
    m, W = training_method("dream"), target.model.get_output_embeddings().weight.detach().float()
    batch = m.collate(mm, list(range(len(mm))), 0.0, torch.Generator())
    torch.manual_seed(cfg.seed)
    with torch.no_grad():
        before = m.loss(m.head(target).float(), batch, W, 0.1)[0].item()
        after = m.loss(DreamHead.load(out).float(), batch, W, 0.1)[0].item()
    assert after < 0.8 * before, (before, after)
    assert json.loads((out / "config.json").read_text())["method"] == "dream"
    d = load_drafter(str(out), target)
    assert isinstance(d, DreamDrafter) and d.head.cross.attn_gate.item() != d.head.cfg.gate_init  # the gate trained
    for i in range(3):
        req = Request(prompt="describe the image", images=tuple(random_images(1, seed=200 + i)))
        assert SpecEngine(target, d, TREE).generate(req, max_new_tokens=24).token_ids == \
            AREngine(target).generate(req, max_new_tokens=24).token_ids


@pytest.mark.parametrize("family", list(FAMILIES))
def test_trained_dream_is_lossless_on_every_family_and_request(family, tmp_path):
    """Briefly trained on the family's own requests; greedy spec == AR == HF generate on each, VTC at 75 % and
    25 %, and the trained drafter really drafts (accepts tokens)."""
    torch.manual_seed(0)
    target = build_target(family)
    reqs = FAMILIES[family].requests
    mm = _features(target, [r for n, r in reqs.items() if n != "text"] * 2, tmp_path / "mm", n_tokens=12)
    cfg = TrainConfig(epochs=4, batch_size=2, lr=3e-3, warmup_steps=1)
    out = train_drafter("dream", target, mm, tmp_path / "d", cfg)
    top1 = check_learned(out)
    d = load_drafter(str(out), target)
    vtc = lambda: ((keep, with_cfg(d, vtc_keep=keep)) for keep in (0.75, 0.25))  # noqa: E731
    accepted = check_greedy_lossless(target, reqs, vtc, family)
    print(f"{family}: {accepted} drafts accepted")
    assert accepted > 0, (family, top1)


def test_dream_sampling_output_distribution_equals_the_target(tmp_path):
    """An image request at T 0.8, top-k 4, top-p 0.9 through a briefly trained DREAM drafter (VTC 75 %): 3-token
    answers match the exact warped target distribution (chi-square at p = 1e-4, 1,500 samples)."""
    from test_engine import SAMPLED_FLOOR, check_trained_drafter_samples

    target = wrap(*tiny_llava(init=0.08))
    req = Request(prompt="describe the image", images=tuple(random_images(1, seed=7)))
    mm = _features(target, [Request(prompt="describe the image", images=tuple(random_images(1, seed=i)))
                            for i in range(8)], tmp_path / "mm", n_tokens=8)
    cfg = TrainConfig(epochs=8, batch_size=4, lr=1e-2, warmup_steps=1)
    out = train_drafter("dream", target, mm, tmp_path / "d", cfg)
    d = load_drafter(str(out), target)
    check_trained_drafter_samples(target, d, req, min_accepted=SAMPLED_FLOOR)


def test_attention_probes_of_decoders_in_two_threads_never_mix():
    """DREAM's attention statistics (the probe wraps HF's attention function) of two targets prefilled at once in
    two threads equal what each gives alone; a forward in another thread while a probe is open is not recorded."""
    import threading

    from mmspec_ray.targets.attention import probe_attention

    targets = [wrap(*tiny_llava(seed=s, init=0.3)) for s in (1, 2)]
    reqs = [Request(prompt="describe the image", images=tuple(random_images(1, seed=s))) for s in (3, 4)]
    layers = (0, 1)

    def entropy(i: int) -> dict:
        with torch.inference_mode():
            out = targets[i].prefill(targets[i].encode(reqs[i]), entropy_layers=layers)
        return {k: v.clone() for k, v in out.attention_entropy.items()}

    alone = [entropy(0), entropy(1)]
    got: dict[int, list] = {0: [], 1: []}

    def worker(i: int) -> None:
        for _ in range(6):
            got[i].append(entropy(i))

    threads = [threading.Thread(target=worker, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in (0, 1):
        for e in got[i]:
            assert set(e) == set(alone[i]) and all(torch.equal(e[k], alone[i][k]) for k in e), i
    # probes that overlap without nesting: the other thread opens its probe first and closes it while this one is
    # open; this one must still record its own forward (a probe that swapped HF's function in and out would have
    # restored the unwrapped one under it), and nothing of the other thread's
    opened, go, closed = threading.Event(), threading.Event(), threading.Event()

    def other() -> None:
        with probe_attention(targets[1].model, layers):
            opened.set()
            go.wait(30)
            with torch.inference_mode():
                targets[1].model(**targets[1].encode(reqs[1]))
        closed.set()

    t = threading.Thread(target=other)
    t.start()
    opened.wait(30)
    with probe_attention(targets[0].model, layers) as records:
        go.set()
        closed.wait(30)
        assert records == {}  # the other thread's forward went to its own probe
        with torch.inference_mode():
            targets[0].model(**targets[0].encode(reqs[0]))
        assert sorted(records) == sorted(layers), records
    t.join()


def test_features_stored_without_attention_are_featurized_again(tmp_path):
    """A DREAM feature set made before examples carried `received` is stale: `with_attention` featurizes it again
    from its stored answers (the same examples, now with the prompt's attention); a fresh set is kept as it is.
    An out-of-range vtc_keep is refused."""
    import dataclasses

    from mmspec_ray.training.datagen import lacks_attention, with_attention
    from mmspec_ray.training.methods import DreamMethod
    from mmspec_ray.training.shards import ShardStore

    target = wrap(*tiny_llava(init=0.3))
    reqs = [Request(prompt="describe the image", images=tuple(random_images(1, seed=i))) for i in range(2)]
    reqs.append(Request(prompt="say something"))
    recipe = DatagenRecipe(max_new_tokens=4, mid_features=True)
    folder = generate_features(target, reqs, recipe, tmp_path / "f-mid")
    new = load_features(folder)
    assert not lacks_attention(folder) and with_attention(target, reqs, folder, recipe) == folder
    store = ShardStore(str(folder))
    for name in store.manifest()["shards"]:  # as an earlier version stored them
        info = store.shard_info(name)
        store.write_shard(name, [dataclasses.replace(ex, received=None) for ex in store.load_shard(name)], info.ids,
                          info.errors)
    assert lacks_attention(folder)
    assert with_attention(target, reqs, folder, recipe) == folder and not lacks_attention(folder)
    again = load_features(folder)
    assert [ex.input_ids.tolist() for ex in again] == [ex.input_ids.tolist() for ex in new]
    assert [ex.received is None for ex in again] == [False, False, True]  # the text-only prompt has no media
    assert all(torch.equal(a.received, b.received) for a, b in zip(again[:2], new[:2]))
    for keep in (0.0, 1.5):
        with pytest.raises(ValueError, match="vtc_keep"):
            DreamMethod(vtc_keep=keep)
