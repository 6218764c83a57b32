"""DREAM ablations on a toy world (docs/drafters/dream.md).

  vtc-train --target toy-m --examples 200 [--gate-init G] [--epochs N] [--heldout N] OUT_ROOT
                          one drafter per VTC rate (OUT_ROOT/dream-vtc100 / -vtc75 / -vtc50 / -vtc25), each trained
                          with vtc_keep at its rate: training reads the compressed stream drafting reads, so each
                          rate needs its own training
  vtc DIR OUT_ROOT        copies of the trained drafter DIR with config.json's vtc_keep set to 100 / 75 / 50 / 25 %
                          (OUT_ROOT/dream-vtc100 ...): the same weights, trained at DIR's rate (75 % by default),
                          evaluated at other rates; only drafting changes (lossless at any rate), so a copy at
                          another rate reads a stream its head was not trained on (vtc-train trains each rate)
  nomid --target toy-m --examples 200 [--gate-init G] --out DIR
                          the same recipe as `mmspec train-drafter --method dream` without the intermediate
                          distillation term (w_mid = 0), on the same prompts and answers
  gates --target toy-m --examples 200 --gate-init 1.0 [--epochs 8] [--heldout 12] --out DIR
                          the toy recipe with the cross-attention gates initialised at --gate-init (the authors' 0
                          keeps the block shut: it gets no gradient there)
  top1 --target toy-m DRAFTER [DRAFTER ...] [--heldout 24] [--train 24] [--examples 200]
                          teacher-forced depth-1 top-1 agreement with the target's greedy token on held-out
                          validation prompts the target answers (cached beside the toy world's drafter data) and on
                          the first training examples: how well each drafter generalises; for DREAM also the gate
                          values (tanh) and the held-out top-1 with the cross-attention block removed
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

RATES = (1.0, 0.75, 0.5, 0.25)


def vtc_variants(drafter: Path, out_root: Path) -> list[Path]:
    """One checkpoint directory per VTC rate: the same weights, config.json's vtc_keep changed (drafting only: the
    head keeps the rate it was trained at)."""
    cfg = json.loads((drafter / "config.json").read_text())
    outs = []
    for rate in RATES:
        out = out_root / f"dream-vtc{round(rate * 100)}"
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy2(drafter / "model.safetensors", out / "model.safetensors")
        (out / "config.json").write_text(json.dumps({**cfg, "vtc_keep": rate}, indent=2))
        outs.append(out)
    return outs


def train_vtc_rates(target: str, examples: int, out_root: Path, gate_init: float | None = None,
                    epochs: int | None = None, heldout: int | None = None) -> list[Path]:
    """One DREAM drafter per rate of `RATES`, each trained with `vtc_keep` at that rate on the toy recipe (the same
    prompts and answers), into OUT_ROOT/dream-vtcNN."""
    from mmspec_ray.toy.build import build_toy
    from mmspec_ray.toy.drafter import RECIPES, train_drafter_on_world
    from mmspec_ray.training.methods import DreamMethod

    recipe = RECIPES[target].model_copy(update={"examples": examples})
    if heldout is not None:
        recipe = recipe.model_copy(update={"heldout": heldout})
    if epochs is not None:
        recipe = recipe.model_copy(update={"train": recipe.train.model_copy(update={"epochs": epochs})})
    world = build_toy(target)
    return [train_drafter_on_world(world, out_root / f"dream-vtc{round(rate * 100)}",
                                   DreamMethod(vtc_keep=rate, gate_init=gate_init), recipe) for rate in RATES]


def train_without_mid(target: str, examples: int, out: Path, heldout: int | None = None,
                      gate_init: float | None = None) -> Path:
    """DREAM trained with w_mid = 0 (no intermediate distillation), the toy recipe otherwise (`heldout` 0: no
    held-out τ after each epoch, which saves its decoding time; `gate_init`: the head's, None the default)."""
    from mmspec_ray.toy.build import build_toy
    from mmspec_ray.toy.drafter import RECIPES, train_drafter_on_world
    from mmspec_ray.training.methods import DreamMethod

    recipe = RECIPES[target].model_copy(update={"examples": examples})
    if heldout is not None:
        recipe = recipe.model_copy(update={"heldout": heldout})
    return train_drafter_on_world(build_toy(target), out, DreamMethod(w_mid=0.0, gate_init=gate_init), recipe)


def train_with_gates(target: str, examples: int, out: Path, gate_init: float, epochs: int | None = None,
                     heldout: int | None = None) -> Path:
    """DREAM on the toy recipe with the cross-attention gates initialised at `gate_init`."""
    from mmspec_ray.toy.build import build_toy
    from mmspec_ray.toy.drafter import RECIPES, train_drafter_on_world
    from mmspec_ray.training.methods import DreamMethod

    recipe = RECIPES[target].model_copy(update={"examples": examples})
    if heldout is not None:
        recipe = recipe.model_copy(update={"heldout": heldout})
    if epochs is not None:
        recipe = recipe.model_copy(update={"train": recipe.train.model_copy(update={"epochs": epochs})})
    return train_drafter_on_world(build_toy(target), out, DreamMethod(gate_init=gate_init), recipe)


def teacher_forced_top1(method, head, examples, lm_head_weight, batch_size: int = 16) -> float:
    """Share of answer positions where the head's next-token argmax (real features in, no noise) equals the
    target's, pooled over `examples` (the method's own collate and loss, in eval mode)."""
    import torch

    hits = total = 0.0
    head.eval()
    with torch.no_grad():
        for i in range(0, len(examples), batch_size):
            idx = list(range(i, min(len(examples), i + batch_size)))
            batch = method.collate(examples, idx, 0.0, torch.Generator().manual_seed(0))
            _, parts = method.loss(head, batch, lm_head_weight, 0.1)
            n = float(batch["loss_mask"].sum())
            hits, total = hits + parts["top1"] * n, total + n
    return hits / max(1.0, total)


def top1_report(target: str, drafters: list[Path], heldout: int = 24, train: int = 24, examples: int = 200) -> dict:
    """Held-out and training teacher-forced top-1 of each drafter directory (any method), DREAM's gates too; the
    training examples are the first `train` of the `examples`-prompt data the drafters trained on."""
    import copy

    import torch

    from mmspec_ray.targets.registry import load_target
    from mmspec_ray.toy.build import build_toy
    from mmspec_ray.toy.drafter import RECIPES, toy_features
    from mmspec_ray.toy.prompts import toy_requests
    from mmspec_ray.training.datagen import DatagenRecipe, generate_features, load_features, with_attention
    from mmspec_ray.training.methods import training_method

    world = build_toy(target)
    tgt = load_target(world.target)
    recipe = RECIPES[target]
    held_dir = world.root / "drafter-data" / f"validation-n{heldout}-t{recipe.max_new_tokens}-mid"
    held_recipe = DatagenRecipe(max_new_tokens=recipe.max_new_tokens, mid_features=True)
    if not (held_dir / "manifest.json").exists():
        generate_features(tgt, toy_requests(world, "validation", heldout, seed=2), held_recipe, held_dir,
                          total=heldout)
    else:  # a cache made before examples carried the prompts' attention (VTC in training) is made again
        with_attention(tgt, list(toy_requests(world, "validation", heldout, seed=2)), held_dir, held_recipe)
    held = load_features(held_dir)
    train_ex = load_features(toy_features(world, tgt, recipe.model_copy(update={"examples": examples}), mid=True))[:train]
    W = tgt.model.get_output_embeddings().weight.detach().float()
    report = {}
    for path in drafters:
        name = json.loads((path / "config.json").read_text()).get("method", "eagle2")
        m = training_method(name)
        head = m.head_class.load(path).float()
        row = {"method": name, "heldout_top1": teacher_forced_top1(m, head, held, W),
               "train_top1": teacher_forced_top1(m, head, train_ex, W)}
        if hasattr(head, "cross"):
            row["tanh_attn_gate"] = torch.tanh(head.cross.attn_gate).item()
            row["tanh_mlp_gate"] = torch.tanh(head.cross.mlp_gate).item()
            shut = copy.deepcopy(head)
            with torch.no_grad():
                shut.cross.attn_gate.zero_()
                shut.cross.mlp_gate.zero_()
            row["heldout_top1_without_cross_attention"] = teacher_forced_top1(m, shut, held, W)
        report[str(path)] = row
    return {"target": target, "heldout_prompts": len(held), "train_examples": len(train_ex), "drafters": report}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("vtc")
    v.add_argument("drafter", type=Path)
    v.add_argument("out_root", type=Path)
    vt = sub.add_parser("vtc-train")
    vt.add_argument("--target", default="toy-m")
    vt.add_argument("--examples", type=int, default=200)
    vt.add_argument("--gate-init", type=float, default=None, help="the cross-attention gates' initial value")
    vt.add_argument("--epochs", type=int, default=None)
    vt.add_argument("--heldout", type=int, default=None, help="held-out prompts for τ per epoch (default: recipe's)")
    vt.add_argument("out_root", type=Path)
    n = sub.add_parser("nomid")
    n.add_argument("--target", default="toy-m")
    n.add_argument("--examples", type=int, default=200)
    n.add_argument("--out", type=Path, required=True)
    n.add_argument("--heldout", type=int, default=None, help="held-out prompts for τ per epoch (default: recipe's)")
    n.add_argument("--gate-init", type=float, default=None, help="the cross-attention gates' initial value")
    g = sub.add_parser("gates")
    g.add_argument("--target", default="toy-m")
    g.add_argument("--examples", type=int, default=200)
    g.add_argument("--gate-init", type=float, required=True)
    g.add_argument("--epochs", type=int, default=None)
    g.add_argument("--heldout", type=int, default=None, help="held-out prompts for τ per epoch (default: recipe's)")
    g.add_argument("--out", type=Path, required=True)
    t = sub.add_parser("top1")
    t.add_argument("--target", default="toy-m")
    t.add_argument("drafters", type=Path, nargs="+")
    t.add_argument("--heldout", type=int, default=24)
    t.add_argument("--train", type=int, default=24)
    t.add_argument("--examples", type=int, default=200, help="the training data's prompt count (its -mid copy)")
    a = p.parse_args()
    if a.cmd == "vtc":
        print("\n".join(str(o) for o in vtc_variants(a.drafter, a.out_root)))
    elif a.cmd == "vtc-train":
        print("\n".join(str(o) for o in train_vtc_rates(a.target, a.examples, a.out_root, a.gate_init, a.epochs,
                                                         a.heldout)))
    elif a.cmd == "nomid":
        print(train_without_mid(a.target, a.examples, a.out, a.heldout, a.gate_init))
    elif a.cmd == "gates":
        print(train_with_gates(a.target, a.examples, a.out, a.gate_init, a.epochs, a.heldout))
    else:
        print(json.dumps(top1_report(a.target, a.drafters, a.heldout, a.train, a.examples), indent=2))


if __name__ == "__main__":
    main()
