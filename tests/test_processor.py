"""`build_processor` inside a user's own Ray Data pipeline: rows read from a JSON lines file with the user's column
names, preprocess building the decoder's row, postprocess naming the answer, written with `write_json`. Every row
comes back; every good row's answer is the target's greedy AR answer (lossless); a bad media reference comes back
as that row's error columns. One 2-CPU Ray for the module (conftest's `ray_cluster`), shut down at the end."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow as pa
import pytest

ray = pytest.importorskip("ray")

from mmspec_ray import ProcessorConfig, build_processor  # noqa: E402
from mmspec_ray.batch.jobspec import DecodeConfig, JobSpec  # noqa: E402
from mmspec_ray.batch.processor import check_rows  # noqa: E402
from mmspec_ray.batch.storage import JobInputError  # noqa: E402
from mmspec_ray.config import SamplingParams  # noqa: E402
from mmspec_ray.decoding.engine import AREngine  # noqa: E402
from mmspec_ray.media import load_image  # noqa: E402
from mmspec_ray.targets import Request, load_target  # noqa: E402
from tiny import random_images  # noqa: E402

MAX_NEW = 8

# the user's hooks below live in this test module, which Ray workers cannot import: ship by value
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def user_rows(tmp_path: Path) -> list[dict]:
    """The user's own rows: a key, a question, a picture path (or none); the last picture does not exist."""
    paths = []
    for i, img in enumerate(random_images(2, seed=11)):
        paths.append(tmp_path / f"pic-{i}.png")
        img.save(paths[-1])
    return [
        {"key": "q-0", "question": "what is in the picture", "picture": str(paths[0])},
        {"key": "q-1", "question": "which colours", "picture": str(paths[1])},
        {"key": "q-2", "question": "red blue circle", "picture": None},
        {"key": "q-bad", "question": "and this one", "picture": str(tmp_path / "missing.png")},
    ]


def to_decoder(row: dict) -> dict:
    """The user's preprocess: their columns -> the decoder's (`id`, `prompt`, `image_uri`)."""
    return {"id": row["key"], "prompt": f"Question: {row['question']}", "image_uri": row["picture"]}


def to_user(row: dict) -> dict:
    """The user's postprocess: keep their key, name the answer, keep the error columns."""
    ids = row["output_token_ids"]
    return {"key": row["id"], "answer": row["output_text"],
            "answer_ids": None if ids is None else [int(t) for t in ids],
            "error": row["error"], "error_kind": row["error_kind"]}


def test_processor_in_a_users_pipeline_answers_every_row_as_ar_does(ray_cluster, ckpt, tmp_path):
    rows = user_rows(tmp_path)
    src = tmp_path / "questions.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = ProcessorConfig(
        decode=DecodeConfig(target=ckpt, drafter="ngram", max_new_tokens=MAX_NEW,
                            tree={"top_k": 2, "depth": 3, "total_tokens": 6}),
        num_actors=1, rows_per_block=2)
    processor = build_processor(config, preprocess=to_decoder, postprocess=to_user)
    assert processor.plan["drafter"] == "ngram" and processor.spec.gpus_per_actor == 0

    out_dir = tmp_path / "answers"
    processor(ray.data.read_json(str(src))).write_json(str(out_dir))

    got = {r["key"]: r for f in sorted(out_dir.glob("*.json")) for r in map(json.loads, f.read_text().splitlines())}
    assert sorted(got) == sorted(r["key"] for r in rows), "every row comes back, once"
    assert set(got["q-0"]) == {"key", "answer", "answer_ids", "error", "error_kind"}, "postprocess shapes the row"
    bad = got.pop("q-bad")
    assert bad["error_kind"] == "media.not_found" and bad["error"].startswith("image_uri: "), bad
    assert bad["answer"] is None and bad["answer_ids"] is None
    ar = AREngine(load_target(ckpt))
    for r in rows[:3]:
        images = (load_image(r["picture"]),) if r["picture"] else ()
        want = ar.generate(Request(prompt=f"Question: {r['question']}", images=images), SamplingParams(), MAX_NEW)
        assert got[r["key"]]["error"] is None, got[r["key"]]["error"]
        assert got[r["key"]]["answer_ids"] == list(want.token_ids), r["key"]
        assert got[r["key"]]["answer"] == want.text


def test_rows_the_decoder_cannot_read_stop_the_pipeline_naming_the_field(ckpt):
    cfg = DecodeConfig(target=ckpt, drafter="ngram")
    good = pa.table({"id": ["a", "b"], "prompt": ["p", "q"]})
    assert check_rows(good, cfg) is good
    with pytest.raises(JobInputError, match=r"no `id` column.*set row\['id'\] in preprocess"):
        check_rows(pa.table({"prompt": ["p"]}), cfg)
    with pytest.raises(JobInputError, match="null id"):
        check_rows(pa.table({"id": pa.array([None, "b"], pa.string()), "prompt": ["p", "q"]}), cfg)
    with pytest.raises(JobInputError, match="duplicated ids"):
        check_rows(pa.table({"id": ["a", "a"], "prompt": ["p", "q"]}), cfg)
    with pytest.raises(JobInputError, match="ids must be strings or integers"):
        check_rows(pa.table({"id": [1.5], "prompt": ["p"]}), cfg)
    with pytest.raises(JobInputError, match="no `prompt` or `messages` column"):
        check_rows(pa.table({"id": ["a"], "question": ["p"]}), cfg)
    with pytest.raises(JobInputError, match=r"output column\(s\) \['error'\]"):
        check_rows(pa.table({"id": ["a"], "prompt": ["p"], "error": ["x"]}), cfg)


def test_processor_pool_settings_are_the_jobs():
    """One definition of each pool setting: the processor's defaults and bounds are the job's."""
    for name in ("num_actors", "min_actors", "gpus_per_actor", "cpus_per_actor", "cpus_per_task", "rows_per_block",
                 "max_row_crashes"):
        assert ProcessorConfig.model_fields[name].default == JobSpec.model_fields[name].default, name
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        ProcessorConfig(decode={"target": "t"}, num_actors=0)
    with pytest.raises(ValueError, match="Extra inputs"):
        ProcessorConfig(decode={"target": "t"}, output="s3://b/out/")  # no output: the caller writes
