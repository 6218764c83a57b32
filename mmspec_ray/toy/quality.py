"""Quality gate of a toy target on the held-out split: does it really look at the pixels?

Scenes: the brief caption must name every object's colour and shape and the right count.
Clips: the caption must name the right action. Detailed descriptions must not degenerate.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pyarrow.parquet as pq
import torch
from tqdm.auto import tqdm

from mmspec_ray.media import load_image, load_video
from mmspec_ray.targets.hf import chat_inputs, load_hf_vlm, video_frames_for
from mmspec_ray.toy.text import ACTION_PHRASE
from mmspec_ray.toy.vocab import COLOURS, SHAPES

_OBJ = re.compile(rf"\b(small|medium|large) ({'|'.join(COLOURS)}) ({'|'.join(SHAPES)})\b")


@dataclass
class QualityReport:
    scenes: int
    colour_acc: float
    shape_acc: float
    count_acc: float
    all_three_acc: float
    clips: int
    action_acc: float
    detail_samples: int
    degenerate_frac: float
    eos_frac: float
    mean_detail_tokens: float
    action_right: dict[str, str] = field(default_factory=dict)  # per action: "right / clips" (which ones fail)

    def passed(self) -> bool:
        return (min(self.colour_acc, self.shape_acc, self.count_acc) >= 0.9 and self.action_acc >= 0.8
                and self.degenerate_frac == 0.0)


def parse_objects(text: str) -> list[tuple[str, str]]:
    """(colour, shape) of every 'size colour shape' phrase in an answer."""
    return [(m.group(2), m.group(3)) for m in _OBJ.finditer(text)]


def is_degenerate(ids: list[int], run: int = 8) -> bool:
    """True when the answer ends in one token repeated `run` times (the classic collapse)."""
    return len(ids) >= run and len(set(ids[-run:])) == 1


@torch.inference_mode()
def greedy(model, processor, prompt: str, images: list, max_new_tokens: int) -> list[int]:
    inputs = chat_inputs(processor, prompt, images)
    out = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def evaluate(target: str | Path, data: str | Path, split: str = "test", max_scenes: int | None = None,
             max_clips: int | None = None, detail_samples: int = 40) -> QualityReport:
    model, processor = load_hf_vlm(target)
    tok = processor.tokenizer
    rows = pq.read_table(Path(data) / f"{split}.parquet").to_pylist()
    scenes = list({r["media_path"]: r for r in rows if r["media_type"] == "image"}.values())[:max_scenes]
    clips = list({r["media_path"]: r for r in rows if r["media_type"] == "video"}.values())[:max_clips]
    nf = video_frames_for(target)
    col = shp = cnt = allc = 0
    for r in tqdm(scenes, desc="gate: scenes", unit="scene"):
        truth = [(o["colour"], o["shape"]) for o in json.loads(r["meta"])["objects"]]
        img = load_image(str(Path(data) / r["media_path"]))
        got = parse_objects(tok.decode(greedy(model, processor, "Describe the image briefly.", [img], 80)))
        c = Counter(x[0] for x in got) == Counter(x[0] for x in truth)
        s = Counter(x[1] for x in got) == Counter(x[1] for x in truth)
        n = len(got) == len(truth)
        col, shp, cnt = col + c, shp + s, cnt + n
        allc += Counter(got) == Counter(truth)
    act = 0
    per_action: dict[str, list[int]] = {}
    for r in tqdm(clips, desc="gate: clips", unit="clip"):
        action = json.loads(r["meta"])["action"]
        frames = load_video(str(Path(data) / r["media_path"]), nf).frames
        text = tok.decode(greedy(model, processor, "What is happening in the video?", frames, 40))
        act += ACTION_PHRASE[action] in text
        per_action.setdefault(action, []).append(ACTION_PHRASE[action] in text)
    degen = eos = 0
    lengths = []
    for r in tqdm(scenes[:detail_samples], desc="gate: detail", unit="answer"):
        img = load_image(str(Path(data) / r["media_path"]))
        ids = greedy(model, processor, "Describe the image in detail.", [img], 240)
        degen += is_degenerate(ids)
        eos += bool(ids) and ids[-1] == tok.eos_token_id
        lengths.append(len(ids))
    ns, nc, nd = max(1, len(scenes)), max(1, len(clips)), max(1, len(lengths))
    return QualityReport(len(scenes), col / ns, shp / ns, cnt / ns, allc / ns, len(clips), act / nc,
                         len(lengths), degen / nd, eos / nd, sum(lengths) / nd,
                         {a: f"{sum(v)} / {len(v)}" for a, v in sorted(per_action.items())})


def report_markdown(rep: QualityReport, name: str) -> str:
    d = asdict(rep)
    d.update({f"action right: {a}": v for a, v in d.pop("action_right").items()})
    lines = [f"| metric ({name}) | value |", "|---|---|"] + [f"| {k} | {v:.3f} |" if isinstance(v, float)
                                                             else f"| {k} | {v} |" for k, v in d.items()]
    lines.append(f"| gate passed | {rep.passed()} |")
    return "\n".join(lines)
