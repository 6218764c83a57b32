"""The `mmspec` command: build the toy world, check its quality, generate answers, train drafters, benchmark.

The main batch job is `jobs/caption_kinetics.py` (Ray Data); this command is for single requests and tooling."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

log = logging.getLogger("mmspec")
M = TypeVar("M", bound=BaseModel)
SAMPLING_FLAGS = {"temperature": "--temperature", "top_p": "--top-p", "top_k": "--top-k", "min_p": "--min-p",
                  "repetition_penalty": "--repetition-penalty", "seed": "--seed"}
TREE_FLAGS = {"top_k": "--tree-top-k", "depth": "--tree-depth", "total_tokens": "--tree-tokens"}
TRAINED_METHODS = ("eagle2", "eagle3", "msd", "specflash", "hivis", "vispec", "dream", "suffix")  # methods `train-drafter` trains (mmspec_ray.training.methods.METHODS)


class UsageError(Exception):
    """A command-line parameter out of range: printed as one line naming the flag (exit code 2), before any load."""


def one_line(e: ValidationError, flags: dict[str, str] | None = None) -> str:
    """A pydantic validation error as one line per the first error, the field named by its flag."""
    err = e.errors()[0]
    field = str(err["loc"][-1]) if err["loc"] else ""
    flag = (flags or {}).get(field, "--" + field.replace("_", "-"))
    more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
    return f"{flag}: {err['msg'].lower()} (got {err.get('input')!r}){more}"


def checked(model: type[M], flags: dict[str, str], **values: Any) -> M:
    """`model(**values)`; a validation error becomes a one-line UsageError naming the flag (`flags`: field -> flag)."""
    try:
        return model(**values)
    except ValidationError as e:
        raise UsageError(one_line(e, flags)) from None


def cmd_toy_build(a: argparse.Namespace) -> int:
    from mmspec_ray.toy.build import build_toy

    w = build_toy(a.size, seed=a.seed, force=a.force)
    print(json.dumps({"root": str(w.root), **w.manifest()["timings"]}, indent=2))
    return 0


def cmd_toy_gate(a: argparse.Namespace) -> int:
    from mmspec_ray.toy.build import build_toy
    from mmspec_ray.toy.quality import evaluate, report_markdown

    w = build_toy(a.size, seed=a.seed)
    rep = evaluate(w.target, w.data, a.split, max_scenes=a.max_scenes, max_clips=a.max_clips)
    print(report_markdown(rep, a.size))
    return 0 if rep.passed() else 1


def cmd_toy_requests(a: argparse.Namespace) -> int:
    import pyarrow.parquet as pq

    from mmspec_ray.toy.build import build_toy
    from mmspec_ray.toy.prompts import toy_request_table

    table = toy_request_table(build_toy(a.size), a.split, a.limit, seed=a.seed)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, a.out)
    print(f"{table.num_rows} {a.size} {a.split} requests -> {a.out}")
    return 0


def resolve_drafter(drafter: str | None, target: str) -> str | None:
    """A drafter checkpoint directory, a training-free method name, a trained method name on a toy target
    (e.g. `--target toy-s --drafter eagle2`: the toy world's drafter, trained on first use), `auto`, or
    `draft-model:PATH` (a smaller checkpoint of the target's family; PATH may name a toy world, e.g. toy-s)."""
    from mmspec_ray.toy.model import TOY_SIZES

    if drafter == "auto":
        from mmspec_ray.toy.drafter import resolve_auto_drafter

        return resolve_auto_drafter(drafter, target)
    if drafter and drafter.startswith("draft-model:"):  # a smaller sibling checkpoint; a toy name is its directory
        from mmspec_ray.toy.resolve import resolve_target

        return "draft-model:" + resolve_target(drafter.removeprefix("draft-model:"))
    if drafter in TRAINED_METHODS and target in TOY_SIZES:
        from mmspec_ray.toy.drafter import build_toy_drafter

        return str(build_toy_drafter(target, drafter))
    # refused before any model is loaded; "suffix" alone is a drafter on any target (an empty corpus that learns
    # from the answers it decodes)
    if drafter in TRAINED_METHODS and drafter != "suffix" and not Path(drafter).exists():
        raise UsageError(f"--drafter {drafter}: a method name stands for the toy world's drafter, so it needs a toy "
                         "target (toy-s, toy-m); for this checkpoint give a drafter checkpoint directory (train one "
                         "with `mmspec train-drafter --data ...`)")
    return drafter


def fixed_tree(a: argparse.Namespace):
    """The TreeConfig of the --tree-* flags (unset ones at TreeConfig's defaults), or None when none is set."""
    from mmspec_ray.decoding.tree import TreeConfig

    given = {k: getattr(a, flag[2:].replace("-", "_")) for k, flag in TREE_FLAGS.items()}
    given = {k: v for k, v in given.items() if v is not None}
    return checked(TreeConfig, TREE_FLAGS, **given) if given else None


def check_drafter_first(spec: str | None, target: Path) -> None:
    """A drafter directory that cannot run on `target`, refused from the files and the target's config before the
    (minutes-long) target load; a target whose tensor table cannot be read is left to its own load to refuse."""
    from mmspec_ray.drafters.facts import facts_from_layout
    from mmspec_ray.drafters.preflight import check_drafter, needs_check
    from mmspec_ray.targets.layout import read_layout
    from mmspec_ray.targets.request import TargetError

    if not needs_check(spec):
        return
    try:
        layout = read_layout(str(target))
    except (TargetError, OSError, ValueError, KeyError):  # e.g. .bin weights: load_target says what is wrong
        return
    check_drafter(spec, facts_from_layout(layout))


def cmd_generate(a: argparse.Namespace) -> int:
    from mmspec_ray.config import SamplingParams
    from mmspec_ray.drafters.base import load_drafter
    from mmspec_ray.media import load_image, load_video
    from mmspec_ray.decoding.calibrate import auto_tree
    from mmspec_ray.decoding.engine import SpecEngine
    from mmspec_ray.targets import Request, load_target
    from mmspec_ray.targets.hf import video_frames_for
    from mmspec_ray.targets.registry import fetch_checkpoint
    from mmspec_ray.toy.resolve import resolve_target

    if a.image and a.video:
        raise SystemExit("give --image or --video, not both")
    for flag, value in (("--max-new-tokens", a.max_new_tokens), ("--num-frames", a.num_frames)):
        if value is not None and value < 1:  # checked before the (minutes-long) model load
            raise UsageError(f"{flag}: must be at least 1 (got {value})")
    sampling = checked(SamplingParams, SAMPLING_FLAGS, **{k: getattr(a, k) for k in SAMPLING_FLAGS})
    tree = fixed_tree(a)
    path = fetch_checkpoint(resolve_target(a.target))  # s3:// (S3Config.from_env) -> its local cache directory
    drafter_spec = resolve_drafter(a.drafter, a.target)
    check_drafter_first(drafter_spec, path)
    target = load_target(path, dtype=a.dtype)
    drafter = load_drafter(drafter_spec, target)
    guard = tree is None  # the calibrated tree comes with the payoff guard; a tree given by flags is used as given
    if tree is None:  # no tree flag: the tree calibrated for this target, drafter and machine
        tree = auto_tree(target, drafter_spec or "none", recalibrate=a.recalibrate,
                         probe=getattr(drafter, "probe_tree", None))
    images = (load_image(a.image),) if a.image else ()
    videos = (tuple(load_video(a.video, a.num_frames or video_frames_for(path)).frames),) if a.video else ()
    engine = SpecEngine(target, drafter, tree, tie_margin=a.tie_margin, guard=guard)
    request = Request(prompt=a.prompt, images=images, videos=videos)
    g = engine.generate(request, sampling, max_new_tokens=a.max_new_tokens)
    print(g.text)
    st = g.stats
    log.info("%d tokens (%s) in %.2f s; %d target forwards, %.2f accepted draft tokens per cycle",
             len(g.token_ids), g.finish_reason, st.total_s, st.cycles, st.mean_accepted)
    return 0


def cmd_train_drafter(a: argparse.Namespace) -> int:
    from mmspec_ray.toy.model import TOY_SIZES

    if a.data is not None:  # any target (a toy world's too): requests -> Ray Data datagen -> training -> --out
        from mmspec_ray.toy.resolve import resolve_target
        from mmspec_ray.training.cli import run

        return run(a, resolve_target(a.target))
    if a.dry_run:
        raise UsageError("--dry-run plans a run on request rows: give --data (`mmspec toy requests` writes a toy "
                         "world's)")
    if a.target in TOY_SIZES:
        from mmspec_ray.toy.drafter import build_toy_drafter, recipe_for, train_drafter_on_world
        from mmspec_ray.toy.build import build_toy

        if a.out is None and (a.examples or a.epochs or a.text_examples or a.text_epochs is not None or a.direct
                              or a.multistep_epochs is not None or a.long_answers is not None
                              or a.answer_temperature is not None or a.method_option):
            raise UsageError("--examples, --epochs, --text-examples, --text-epochs, --multistep-epochs, "
                             "--direct, --long-answers / --plain-answers, --answer-temperature and "
                             "--method-option change the recipe: give --out too (the cached toy drafter keeps "
                             "the default recipe)")
        if a.method == "auto":  # the same rule, on the world's own prompts and text-only corpus
            from mmspec_ray.training.cli import toy_auto_method

            a.method, why = toy_auto_method(a.target, a.examples, a.text_examples, bool(a.answer_temperature))
            print(f"method   {a.method}: {why}", flush=True)
        if a.out is None:
            print(build_toy_drafter(a.target, a.method, force=a.force))
            return 0
        recipe = recipe_for(a.target, a.method)
        if a.examples:
            recipe = recipe.model_copy(update={"examples": a.examples})
        if a.text_examples:
            recipe = recipe.model_copy(update={"text_examples": a.text_examples})
        if a.long_answers is not None or a.answer_temperature is not None:
            recipe = recipe.model_copy(update={"long_answers": a.long_answers,
                                               "answer_temperature": a.answer_temperature})
        train = {k: v for k, v in (("epochs", a.epochs), ("text_epochs", a.text_epochs),
                                   ("multistep_epochs", a.multistep_epochs)) if v is not None}
        if a.direct:
            train["gradual"] = False
        recipe = recipe.model_copy(update={"train": recipe.train.model_copy(update=train)})
        method = a.method
        if a.method_option:
            from mmspec_ray.training.cli import method_options
            from mmspec_ray.training.methods import training_method

            method = training_method(a.method, method_options(a.method_option))
        print(train_drafter_on_world(build_toy(a.target), Path(a.out), method, recipe, resume=not a.force))
        return 0
    raise UsageError(f"--target {a.target}: a checkpoint needs --data (a parquet of request rows the target "
                     "answers) and --out; without --data only the toy worlds (toy-s, toy-m) train on their own data")


def _assistant(spec: str, target: str):
    """The HF assisted-generation peer's small model: a checkpoint dir, or 'auto' (a grown toy target's source)."""
    from transformers import AutoModelForImageTextToText

    from mmspec_ray.toy.model import TOY_SIZES

    if spec == "auto":
        small = TOY_SIZES[target].grown_from if target in TOY_SIZES else ""
        if not small:
            return None
        from mmspec_ray.toy.build import build_toy

        spec = str(build_toy(small).target)
    return AutoModelForImageTextToText.from_pretrained(spec).eval() if spec else None


def bench_config(a: argparse.Namespace):
    """The BenchConfig of `mmspec bench` flags (the seed included: it seeds every sampled run)."""
    from mmspec_ray.bench.run import BenchConfig
    from mmspec_ray.decoding.tree import TreeConfig

    tree = checked(TreeConfig, TREE_FLAGS, top_k=a.tree_top_k, depth=a.tree_depth, total_tokens=a.tree_tokens)
    return checked(BenchConfig, {}, prompts=a.prompts, max_new_tokens=a.max_new_tokens, repeats=a.repeats,
                   temperatures=tuple(a.temperatures), seed=a.seed, tree=tree, peers=not a.no_peers,
                   payoff_guard=not a.no_payoff_guard, anti_oracle=a.anti_oracle)


def cmd_drafter_inspect(a: argparse.Namespace) -> int:
    """Print what a drafter directory is and, with --target, whether it fits that target. Exit 1 with one line
    when the drafter is refused: `refused: ...` (its files, config or weights) or `fits TARGET: no: ...`."""
    from mmspec_ray.drafters.facts import facts_of
    from mmspec_ray.drafters.files import DrafterError, TargetMismatch
    from mmspec_ray.drafters.preflight import check_dir
    from mmspec_ray.drafters.released import recognise

    path = a.path
    if path.startswith("s3://"):
        from mmspec_ray.drafters.base import check_drafter_files
        from mmspec_ray.targets.registry import fetch_checkpoint

        path = str(fetch_checkpoint(path, check=check_drafter_files, refresh=True))
    target = None
    try:
        info = recognise(path)  # the files themselves, before a target loads
        if a.target:
            from mmspec_ray.targets import load_target
            from mmspec_ray.targets.registry import fetch_checkpoint
            from mmspec_ray.toy.resolve import resolve_target

            target = load_target(fetch_checkpoint(resolve_target(a.target)))
        check_dir(Path(path), facts_of(target) if target is not None else None)
    except TargetMismatch as e:
        print("\n".join(f"{k}: {v}" for k, v in info.describe().items()))
        print(f"fits {a.target}: no: {e}")
        return 1
    except DrafterError as e:
        print(f"refused: {e}")
        return 1
    for k, v in info.describe().items():
        print(f"{k}: {v}")
    if target is not None:
        from mmspec_ray.drafters.base import load_drafter

        try:
            load_drafter(path, target)
        except ValueError as e:
            print(f"fits {a.target}: no: {e}")
            return 1
        print(f"fits {a.target}: yes (hidden size {target.hidden_size}, vocabulary {target.vocab_size}, "
              f"{getattr(target.text_config, 'num_hidden_layers', '?')} decoder layers)")
    return 0


def bench_drafters(spec: str) -> dict[str, str]:
    """`--drafter eagle2,msd,msd-1stage=/path/to/ckpt` -> {label: method name or checkpoint dir}, in order."""
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in (spec or "").split(","))):
        label, _, path = part.partition("=")
        bare = part.rpartition("@")[0] if "@" in part else part  # the label leaves out the tree (@auto, @k4d5n16)
        label, path = (label, path) if path else (Path(bare).name if "/" in bare else bare, part)
        if label in out or label in ("ar", "ar_again", "hf_generate", "hf_prompt_lookup", "hf_assisted", "ngram",
                                       "oracle"):
            raise UsageError(f"--drafter: the label {label!r} is taken; name it as LABEL=PATH")
        out[label] = path
    return out


def bench_workloads(a: argparse.Namespace, target: str) -> list:
    """The `--workloads` of `mmspec bench`: toy workloads (toy targets only) and request parquets, each `--prompts`
    long."""
    from mmspec_ray.bench.workloads import TOY_WORKLOADS, parquet_workload, parse_workloads, toy_workload
    from mmspec_ray.toy.model import TOY_SIZES

    try:
        specs = parse_workloads(a.workloads)
    except ValueError as e:
        raise UsageError(str(e)) from e
    tasks = tuple(a.tasks.split(",")) if a.tasks else None
    out = []
    for name, source in specs:
        if source in TOY_WORKLOADS:
            if a.target not in TOY_SIZES:
                raise UsageError(f"--workloads {name}: a toy workload needs a toy target (toy-s, toy-m); with a "
                                 "checkpoint give request parquets (NAME=PATH or s3:// URI)")
            from mmspec_ray.toy.build import build_toy

            out.append(toy_workload(build_toy(a.target), name, a.prompts, a.seed, tasks))
        else:
            out.append(parquet_workload(name, source, target, a.prompts))
    return out


def cmd_bench(a: argparse.Namespace) -> int:
    from mmspec_ray.bench.run import run_bench, write_results
    from mmspec_ray.targets import load_target
    from mmspec_ray.targets.registry import fetch_checkpoint
    from mmspec_ray.toy.resolve import resolve_target

    drafters = {}
    for label, spec in bench_drafters(a.drafter).items():  # DRAFTER@TREE: the tree of that method (run.split_tree)
        spec, at, tree = spec.rpartition("@") if "@" in spec else (spec, "", "")
        drafters[label] = resolve_drafter(spec, a.target) + at + tree
    path = fetch_checkpoint(resolve_target(a.target))  # s3:// (S3Config.from_env) -> its local cache directory
    workloads = bench_workloads(a, str(path))
    target = load_target(path, device=a.device, dtype=a.dtype)
    cfg = bench_config(a)
    res = run_bench(target, workloads, drafters, cfg, assistant=_assistant(a.assistant, a.target))
    res["command"] = "mmspec " + " ".join(sys.argv[1:])
    n = sum(len(w.requests) for w in workloads)
    out = write_results(res, a.out, f"{a.target}: {n} prompts ({', '.join(w.name for w in workloads)}), "
                        f"max_new_tokens {a.max_new_tokens}")
    print((out / "bench.md").read_text())
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mmspec", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="cmd", required=True)

    toy = sub.add_parser("toy", help="the embedded toy world").add_subparsers(dest="toy_cmd", required=True)
    b = toy.add_parser("build", help="build (or reuse) a toy world under $MMSPEC_HOME")
    b.add_argument("--size", default="toy-s", choices=["toy-s", "toy-m"])
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--force", action="store_true", help="rebuild even if cached")
    b.set_defaults(fn=cmd_toy_build)
    r = toy.add_parser("requests", help="write a split's prompts as a parquet of request rows (e.g. --data of "
                       "train-drafter)")
    r.add_argument("--size", default="toy-s", choices=["toy-s", "toy-m"])
    r.add_argument("--split", default="train")
    r.add_argument("--limit", type=int, default=None)
    r.add_argument("--seed", type=int, default=1)
    r.add_argument("--out", required=True, help="parquet file to write")
    r.set_defaults(fn=cmd_toy_requests)
    g = toy.add_parser("gate", help="quality gate of a toy target on a held-out split")
    g.add_argument("--size", default="toy-s", choices=["toy-s", "toy-m"])
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--split", default="test")
    g.add_argument("--max-scenes", type=int, default=None)
    g.add_argument("--max-clips", type=int, default=None)
    g.set_defaults(fn=cmd_toy_gate)

    gen = sub.add_parser("generate", help="answer one prompt about an image or a video")
    gen.add_argument("--target", default="toy-s", help="checkpoint directory, s3://bucket/prefix, or toy-s / toy-m")
    gen.add_argument("--image")
    gen.add_argument("--video")
    gen.add_argument("--num-frames", type=int, default=None, help="frames sampled from --video")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=None,
                     help="0: greedy; default: the checkpoint's generation config (HF generate's default)")
    gen.add_argument("--top-p", type=float, default=None, help="default: the checkpoint's generation config")
    gen.add_argument("--top-k", type=int, default=None, help="0 disables; default: the checkpoint's (HF's: 50)")
    gen.add_argument("--min-p", type=float, default=None)
    gen.add_argument("--repetition-penalty", type=float, default=None,
                     help="1 disables; default: the checkpoint's generation config")
    gen.add_argument("--tie-margin", type=float, default=None,
                     help="bfloat16/float16: relative top-2 logit gap under which a greedy token is re-decided by a "
                     "one-token forward (default: per dtype; 0: off; docs/design.md, Precision)")
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--drafter", default="auto",
                     help="auto (the default: the toy world's shipped drafter, the one measured fastest there: toy-s "
                     "its suffix drafter, built on first use; toy-m toy-s as draft model; ngram for other targets), "
                     "none (plain AR), ngram, suffix (an empty corpus that learns from the answers it decodes), a "
                     "drafter checkpoint directory (this "
                     "project's, or a released EAGLE-1/2/3 or SpecForge head: `mmspec drafter inspect`), draft-model:PATH (a "
                     "smaller checkpoint of the target's family, same tokenizer and processor; no training; PATH may be "
                     "a toy world name, e.g. toy-s for toy-m), or a method name (eagle2, eagle3, hivis, ...) with a toy "
                     "target")
    gen.add_argument("--tree-top-k", type=int, default=None,
                     help="fix the draft tree (unset ones: top-k 8, depth 5, 48 tokens); with no --tree-* flag the "
                     "tree is calibrated for this target, drafter and machine on first use and cached")
    gen.add_argument("--tree-depth", type=int, default=None)
    gen.add_argument("--tree-tokens", type=int, default=None, help="draft tree size including the root")
    gen.add_argument("--recalibrate", action="store_true", help="calibrate the tree again (ignore the cache)")
    gen.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                     help="the target's dtype; auto: bfloat16 on cuda, float32 on CPU (this command runs on CPU), "
                     "as the batch job; only float32 gives HF generate's greedy output token for token "
                     "(docs/design.md, Precision)")
    gen.set_defaults(fn=cmd_generate)

    td = sub.add_parser("train-drafter", help="generate target-answered features and train a drafter")
    from mmspec_ray.training.cli import AUTO_HELP, add_data_args

    td.add_argument("--method", default="auto", choices=["auto", *TRAINED_METHODS], help=AUTO_HELP)
    td.add_argument("--target", default="toy-s",
                    help="toy-s / toy-m, or (with --data) a checkpoint directory or s3:// prefix")
    td.add_argument("--out", default=None, help="checkpoint directory (default: the toy world's drafters/METHOD)")
    td.add_argument("--examples", type=int, default=None, help="training prompts the target answers")
    td.add_argument("--epochs", type=int, default=None)
    td.add_argument("--text-examples", type=int, default=None,
                    help="text-only training prompts for stage 1 (default: as many as --examples)")
    td.add_argument("--text-epochs", type=int, default=None,
                    help="stage-1 (text-only) epochs; default: the method's (msd: half the epochs, eagle2: 0)")
    td.add_argument("--multistep-epochs", type=int, default=None,
                    help="epochs of the multi-step stage that ends the run (hivis stage 2; default: a third of the "
                    "epochs; 0: stage 1 only). A stage-1 run resumed with more --epochs continues into stage 2")
    td.add_argument("--direct", action="store_true",
                    help="stage 2 all multimodal from its first epoch (default: MSD's gradual text->multimodal ramp)")
    td.add_argument("--long-answers", dest="long_answers", action="store_const", const=True, default=None,
                    help="toy target: train on the prompts rewritten to ask for long answers (ViSpec's stage-2 data; "
                    "default: the method's, vispec only), answered at --answer-temperature")
    td.add_argument("--plain-answers", dest="long_answers", action="store_const", const=False,
                    help="toy target: train on the prompts as they are (the default except for vispec)")
    td.add_argument("--force", action="store_true", help="start over instead of resuming")
    add_data_args(td)
    td.set_defaults(fn=cmd_train_drafter)

    dr = sub.add_parser("drafter", help="drafter checkpoints: inspect one")
    drs = dr.add_subparsers(dest="drafter_cmd", required=True)
    di = drs.add_parser("inspect", help="the layout, method and target dimensions of a drafter directory (this "
                        "project's, or a released EAGLE-1/2/3 or SpecForge head), and whether it fits --target")
    di.add_argument("path", help="drafter directory, or s3://bucket/prefix")
    di.add_argument("--target", default=None, help="also check it against this target (checkpoint dir, s3:// or toy-s "
                    "/ toy-m): loads the target")
    di.set_defaults(fn=cmd_drafter_inspect)

    be = sub.add_parser("bench", help="AR vs drafters vs HF peers on workloads of a target, one interleaved run "
                        "(JSON + markdown + plots)")
    be.add_argument("--target", default="toy-s", help="toy-s / toy-m, a checkpoint directory or s3:// prefix")
    be.add_argument("--workloads", default="all",
                    help="comma list, measured in one run: toy workloads (all, instructions = image tasks, captions = "
                         "video tasks, long = detail answers at max_new_tokens 160, long_images = the same without "
                         "video) and request parquets (file or directory, local or s3://, the batch jobs' rows: id, "
                         "prompt or messages, image(_uri) / video(_uri)) as NAME=URI or URI; a checkpoint target "
                         "needs parquets")
    be.add_argument("--drafter", default="eagle2",
                    help="comma list, run interleaved in one bench: eagle2 / msd / hivis (the toy world's), checkpoint dirs "
                         "or LABEL=DIR; '' for none. DRAFTER@auto: the tree calibrated for it on this machine, under the "
                         "payoff guard; DRAFTER@auto-noguard: that tree alone; DRAFTER@k4d5n16: a fixed tree (top-k 4, depth 5, 16 tokens) for that method")
    be.add_argument("--assistant", default="auto",
                    help="small model for the HF assisted-generation peer: a checkpoint dir, '' for none, or auto "
                         "(toy-m: toy-s, the model it was grown from; none for other targets)")
    be.add_argument("--prompts", type=int, default=12, help="prompts per workload")
    be.add_argument("--tasks", default="", help="comma-separated toy tasks the 'all' workload draws prompts from "
                    "(default: all)")
    be.add_argument("--max-new-tokens", type=int, default=128)
    be.add_argument("--repeats", type=int, default=3)
    be.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    be.add_argument("--tree-top-k", type=int, default=8)
    be.add_argument("--tree-depth", type=int, default=5)
    be.add_argument("--tree-tokens", type=int, default=48)
    be.add_argument("--device", default="cpu",
                    help="cpu (the default), cuda, cuda:N, or auto (cuda when a GPU is visible); the drafters and the "
                    "HF assistant run on the target's device")
    be.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                    help="the target's dtype (as mmspec generate --dtype: auto is bfloat16 on cuda, float32 on cpu)")
    be.add_argument("--seed", type=int, default=0)
    be.add_argument("--anti-oracle", action="store_true",
                    help="also a drafter that is always wrong, on the --tree-* tree, without and with the payoff guard "
                         "(anti_oracle, anti_oracle_guarded): what falling back to plain steps costs against AR")
    be.add_argument("--no-payoff-guard", action="store_true",
                    help="run @auto drafters on their calibrated tree alone, without the payoff guard that shrinks it "
                         "to plain steps where drafting does not pay")
    be.add_argument("--no-peers", action="store_true",
                    help="AR and the --drafter methods only (no HF peers, ngram, oracle): tree sweeps")
    be.add_argument("--out", default="out/bench")
    be.set_defaults(fn=cmd_bench)

    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if a.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return a.fn(a)
    except UsageError as e:
        print(f"mmspec: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # clear one-line error for users; traceback with -v
        if a.verbose:
            raise
        text = one_line(e) if isinstance(e, ValidationError) else f"{type(e).__name__}: {e}"
        print(f"mmspec: error: {text}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
