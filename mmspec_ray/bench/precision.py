"""Greedy agreement by precision: how often speculative output equals AR output, and both equal HF generate, on
the six target families in float32, bfloat16 and float16.

For each family, each dtype and each request: HF `generate(do_sample=False)`, `AREngine` (the null drafter) and
`SpecEngine` with an untrained EAGLE-2 drafter (`Eagle2Drafter.random`, the default tree: top-k 8, depth 5, 48
tokens: wide trees, mostly nothing accepted) and with the oracle drafter (proposes the AR answer as a chain: every
cycle commits several tokens) each answer with `--max-new-tokens` tokens; a pair agrees when the whole answers are
equal token for token. Both drafters are run so that tree-shaped and chain-shaped verify forwards are both measured.

The targets are the tiny random-init models the test suite uses (one per family, two model seeds each, cast with
`model.to(dtype)`): this script imports `tests/families.py` and `tests/tiny*.py` from the repository checkout (it
adds `tests/` to `sys.path`), so it runs from a checkout, not from an installed wheel. Requests are drawn per family
from its request kinds (text, one or two images, a video where the family takes one) with random prompts over the
tiny vocabulary and random images; the same requests and models are used for every dtype.

`nice python -m mmspec_ray.bench.precision` writes `precision.json` + `precision.md` under `--out`
(docs/design.md, "Precision and the tie guard", records its output).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TESTS = Path(__file__).resolve().parents[2] / "tests"
PAIRS = (("ar", "hf"), ("eagle2", "ar"), ("eagle2", "hf"), ("oracle", "ar"), ("oracle", "hf"))
METHODS = ("hf", "ar", "eagle2", "oracle")


def _tests_on_path() -> None:
    if not (TESTS / "families.py").exists():
        raise SystemExit(f"{TESTS}/families.py not found: run this from a repository checkout")
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))


def family_requests(family: str, n: int, seed: int) -> list:
    """`n` requests for `family`: its request kinds in turn (text, image, two images, video where it has them),
    each with a random prompt of 3-9 tiny-vocabulary words and fresh random images of the kind's sizes."""
    _tests_on_path()
    from families import FAMILIES
    from mmspec_ray.targets import Request
    from tiny import WORDS, random_image

    kinds = list(FAMILIES[family].requests.values())
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        like = kinds[i % len(kinds)]
        prompt = " ".join(rng.choice(WORDS, size=int(rng.integers(3, 10))))

        def fresh(img):
            return random_image(img.width, img.height, seed=int(rng.integers(1 << 30)))

        out.append(Request(prompt=prompt, images=tuple(fresh(im) for im in like.images),
                           videos=tuple(tuple(fresh(f) for f in clip) for clip in like.videos)))
    return out


def first_diff(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (None: equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def answers(target, request, max_new_tokens: int, drafter_seed: int,
            tie_margin: float | None = None) -> dict[str, list[int]]:
    """Every method's greedy answer to one request (+ `ties`: [near-tie cycles, cycles] of the two spec runs)."""
    from mmspec_ray.drafters.eagle import Eagle2Drafter
    from mmspec_ray.drafters.oracle import OracleDrafter
    from mmspec_ray.decoding.engine import AREngine, SpecEngine

    inputs = target.encode(request)
    with torch.inference_mode():
        hf = target.model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens)
    out = {"hf": hf[0, inputs["input_ids"].shape[1]:].tolist()}
    out["ar"] = AREngine(target).generate(request, max_new_tokens=max_new_tokens).token_ids
    ties = [0, 0]
    for name, drafter in (("eagle2", Eagle2Drafter.random(target, seed=drafter_seed)),
                          ("oracle", OracleDrafter(out["ar"]))):
        g = SpecEngine(target, drafter, tie_margin=tie_margin).generate(request, max_new_tokens=max_new_tokens)
        out[name] = g.token_ids
        ties = [ties[0] + g.stats.tie_cycles, ties[1] + g.stats.cycles]
    out["ties"] = ties
    return out


def float32_head(target) -> None:
    """The `--float32-head` experiment: `target`'s prefill and verify logits recomputed as lm_head in float32 from
    the post-norm hidden state (HF computes them in the model's dtype, rounding every logit to it). Not what the
    engine does (docs/design.md, "Precision and the tie guard", says why)."""
    head = target.model.get_output_embeddings()
    w, b = head.weight.float(), None if head.bias is None else head.bias.float()
    cap = getattr(target, "logit_softcap", None)  # Gemma3: None unless the model caps its logits
    prefill, verify = target.prefill, target.verify

    def logits(out, keep: int):
        h = out.hidden[:, -keep:] if keep else out.hidden
        x = torch.nn.functional.linear(h.float(), w, b)
        return dataclasses.replace(out, logits=torch.tanh(x / cap) * cap if cap else x)

    target.prefill = lambda inputs, logits_to_keep=1, **kw: logits(prefill(inputs, logits_to_keep, **kw),
                                                                   logits_to_keep)
    target.verify = lambda tokens, ancestors, depth: logits(verify(tokens, ancestors, depth), 0)


def measure(families: list[str], dtypes: list[str], n: int, model_seeds: int, max_new_tokens: int,
            log=print, head32: bool = False, tie_margin: float | None = None) -> dict:
    """Per (family, dtype): per-request records and the agreement counts of every pair in PAIRS."""
    _tests_on_path()
    from families import FAMILIES
    from mmspec_ray.targets import wrap

    res: dict = {"families": {}}
    for fi, family in enumerate(families):
        requests = family_requests(family, n, seed=1000 + fi)
        per_model = [requests[s::model_seeds] for s in range(model_seeds)]  # request i runs on model i % seeds
        res["families"][family] = fam = {}
        ref32: dict[int, list[int]] = {}  # request -> HF generate's float32 answer (dtypes run float32 first)
        for s in range(model_seeds):
            model, processor = FAMILIES[family].builder(seed=s)
            for dname in dtypes:
                target = wrap(copy.deepcopy(model).to(DTYPES[dname]), processor)
                if head32:
                    float32_head(target)
                t0 = time.perf_counter()
                recs = fam.setdefault(dname, {"records": []})["records"]
                for j, req in enumerate(per_model[s]):
                    i = j * model_seeds + s
                    ans = answers(target, req, max_new_tokens, drafter_seed=j, tie_margin=tie_margin)
                    if dname == "float32":
                        ref32[i] = ans["hf"]
                    recs.append({"request": i, "model_seed": s, "kind": _kind(req), "answers": ans,
                                 "distinct_ar": len(set(ans["ar"])),
                                 **{f"{a}_vs_{b}": first_diff(ans[a], ans[b]) for a, b in PAIRS},
                                 **({f"{m}_vs_hf32": first_diff(ans[m], ref32[i]) for m in METHODS}
                                    if i in ref32 else {})})
                log(f"{family} seed {s} {dname}: {len(per_model[s])} requests, {time.perf_counter() - t0:.1f} s")
        for dname, d in fam.items():
            recs = d["records"]
            d["n"] = len(recs)
            keys = [f"{a}_vs_{b}" for a, b in PAIRS] + [f"{m}_vs_hf32" for m in METHODS if f"{m}_vs_hf32" in recs[0]]
            d["agree"] = {k: sum(r[k] is None for r in recs) for k in keys}
            d["prefix_mean"] = {k: float(np.mean([len(r["answers"]["hf"]) if r[k] is None else r[k] for r in recs]))
                                for k in keys}  # tokens before the first difference
            d["distinct_ar_mean"] = float(np.mean([r["distinct_ar"] for r in recs]))
            d["tie_cycle_share"] = (sum(r["answers"]["ties"][0] for r in recs)
                                    / max(1, sum(r["answers"]["ties"][1] for r in recs)))
    return res


def _kind(req) -> str:
    if req.videos:
        return "video"
    return {0: "text", 1: "image"}.get(len(req.images), f"{len(req.images)}_images")


TABLES = (
    ("Greedy answers equal token for token, same dtype", [("AR = HF", "ar_vs_hf"),
     ("spec (eagle2) = AR", "eagle2_vs_ar"), ("spec (eagle2) = HF", "eagle2_vs_hf"),
     ("spec (oracle) = AR", "oracle_vs_ar"), ("spec (oracle) = HF", "oracle_vs_hf")]),
    ("Half-precision answers equal to HF generate's float32 answer (after ';': mean tokens before the first "
     "difference)", [("HF = HF fp32", "hf_vs_hf32"), ("AR = HF fp32", "ar_vs_hf32"),
                     ("spec (eagle2) = HF fp32", "eagle2_vs_hf32"), ("spec (oracle) = HF fp32", "oracle_vs_hf32")]),
)


def markdown(res: dict) -> str:
    """Agreement rates with counts, one row per (family, dtype) and a total per dtype, in two tables."""
    total: dict[str, dict] = {}
    for fam in res["families"].values():
        for dname, d in fam.items():
            t = total.setdefault(dname, {"n": 0, "agree": {}, "prefix_sum": {}})
            t["n"] += d["n"]
            for k, v in d["agree"].items():
                t["agree"][k] = t["agree"].get(k, 0) + v
                t["prefix_sum"][k] = t["prefix_sum"].get(k, 0.0) + d["prefix_mean"][k] * d["n"]
    for t in total.values():
        t["prefix_mean"] = {k: v / t["n"] for k, v in t.pop("prefix_sum").items()}
    out = ["Experiment --float32-head: prefill and verify logits computed as lm_head in float32.\n"
           ] if res.get("float32_head") else []
    for title, cols in TABLES:
        head = ["family", "dtype", "requests"] + [c for c, _ in cols]
        lines = [f"{title}:", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        rows = [(f, dn, d) for f, fam in res["families"].items() for dn, d in fam.items()]
        rows += [("**all**", dn, t) for dn, t in total.items()]
        vs32 = cols[0][1].endswith("hf32")
        for family, dname, d in rows:
            n, agree = d["n"], d["agree"]
            if not all(k in agree for _, k in cols) or (vs32 and dname == "float32"):
                continue  # no float32 run to compare with, or float32 against itself
            cells = [f"{100 * agree[k] / n:.1f} % ({agree[k]}/{n})" + (f"; {d['prefix_mean'][k]:.1f}" if vs32 else "")
                     for _, k in cols]
            lines.append(f"| {family} | {dname} | {n} | " + " | ".join(cells) + " |")
        if len(lines) > 4:
            out.append("\n".join(lines) + "\n")
    means = ", ".join(f"{f} {fam[next(iter(fam))]['distinct_ar_mean']:.1f}" for f, fam in res["families"].items())
    out.append(f"Distinct tokens per AR answer (mean, {next(iter(total))}): {means}.\n")
    ties = {dn: [0, 0] for dn in total}
    for fam in res["families"].values():
        for dname, d in fam.items():
            for r in d["records"]:
                ties[dname] = [ties[dname][0] + r["answers"]["ties"][0], ties[dname][1] + r["answers"]["ties"][1]]
    out.append("Spec cycles ended at a near-tie (re-decided by a one-token forward; tie margin "
               f"{res.get('tie_margin') if res.get('tie_margin') is not None else 'engine default'}): "
               + ", ".join(f"{dn} {100 * a / max(1, b):.1f} % ({a}/{b})" for dn, (a, b) in ties.items()) + ".\n")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", default="llava,llava_next,llava_onevision,qwen2_5_vl,idefics3,gemma3")
    p.add_argument("--dtypes", default="float32,bfloat16,float16")
    p.add_argument("--requests", type=int, default=40, help="requests per family (and dtype)")
    p.add_argument("--model-seeds", type=int, default=2, help="tiny models per family (requests split among them)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--float32-head", action="store_true",
                   help="experiment: the engine's logits computed as lm_head in float32 (see float32_head)")
    p.add_argument("--tie-margin", type=float, default=None,
                   help="relative top-2 logit gap below which spec re-decides a greedy token with a one-token forward "
                        "(default: the engine's per-dtype TIE_MARGIN; 0 turns the guard off)")
    p.add_argument("--out", default="out/precision")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    import transformers

    transformers.logging.set_verbosity_error()
    t0 = time.perf_counter()
    res = measure(a.families.split(","), a.dtypes.split(","), a.requests, a.model_seeds, a.max_new_tokens,
                  log=lambda m: print(m, file=sys.stderr, flush=True), head32=a.float32_head,
                  tie_margin=a.tie_margin)
    res.update(command="python -m mmspec_ray.bench.precision " + " ".join(argv if argv is not None else sys.argv[1:]),
               max_new_tokens=a.max_new_tokens, float32_head=a.float32_head, tie_margin=a.tie_margin,
               requests=a.requests,
               model_seeds=a.model_seeds,
               machine=platform.processor() or platform.machine(), torch=torch.__version__,
               transformers=transformers.__version__, threads=a.threads, seconds=round(time.perf_counter() - t0, 1))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "precision.json").write_text(json.dumps(res, indent=1))
    md = markdown(res)
    (out / "precision.md").write_text(md)
    print(md)
    print(f"{res['seconds']} s; {out}/precision.json", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
