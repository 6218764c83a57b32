"""DREAM ablations on a toy world (docs/drafters/dream.md).

  vtc DIR OUT_ROOT        copies of the trained drafter DIR keeping 100 / 75 / 50 / 25 % of the visual tokens
                          (OUT_ROOT/dream-vtc100 ...): VTC acts at inference only (the authors' code trains on full
                          sequences), so one trained drafter serves every rate
  nomid --target toy-m --examples 200 --out DIR
                          the same recipe as `mmspec train-drafter --method dream` without the intermediate
                          distillation term (w_mid = 0), on the same prompts and answers
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

RATES = (1.0, 0.75, 0.5, 0.25)


def vtc_variants(drafter: Path, out_root: Path) -> list[Path]:
    """One checkpoint directory per VTC rate: the same weights, config.json's vtc_keep changed."""
    cfg = json.loads((drafter / "config.json").read_text())
    outs = []
    for rate in RATES:
        out = out_root / f"dream-vtc{round(rate * 100)}"
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy2(drafter / "model.safetensors", out / "model.safetensors")
        (out / "config.json").write_text(json.dumps({**cfg, "vtc_keep": rate}, indent=2))
        outs.append(out)
    return outs


def train_without_mid(target: str, examples: int, out: Path, heldout: int | None = None) -> Path:
    """DREAM trained with w_mid = 0 (no intermediate distillation), the toy recipe otherwise (`heldout` 0: no
    held-out τ after each epoch, which saves its decoding time)."""
    from mmspec_ray.toy.build import build_toy
    from mmspec_ray.toy.drafter import RECIPES, train_drafter_on_world
    from mmspec_ray.training.methods import DreamMethod

    recipe = RECIPES[target].model_copy(update={"examples": examples})
    if heldout is not None:
        recipe = recipe.model_copy(update={"heldout": heldout})
    return train_drafter_on_world(build_toy(target), out, DreamMethod(w_mid=0.0), recipe)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("vtc")
    v.add_argument("drafter", type=Path)
    v.add_argument("out_root", type=Path)
    n = sub.add_parser("nomid")
    n.add_argument("--target", default="toy-m")
    n.add_argument("--examples", type=int, default=200)
    n.add_argument("--out", type=Path, required=True)
    n.add_argument("--heldout", type=int, default=None, help="held-out prompts for τ per epoch (default: recipe's)")
    a = p.parse_args()
    if a.cmd == "vtc":
        print("\n".join(str(o) for o in vtc_variants(a.drafter, a.out_root)))
    else:
        print(train_without_mid(a.target, a.examples, a.out, a.heldout))


if __name__ == "__main__":
    main()
