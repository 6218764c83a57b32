"""Prompts and reference answers for toy scenes and clips: captions, detailed descriptions, questions, instructions.

Every content word of an answer (colour, shape, size, place, count, action) is a function of the pixels.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from mmspec_ray.toy.clips import Clip
from mmspec_ray.toy.scenes import Scene, ToyObject
from mmspec_ray.toy.vocab import COLOURS, NUMBER_WORDS, POSITIONS, SHAPES

PLACE = {
    "top left": "at the top left", "top": "at the top", "top right": "at the top right",
    "left": "on the left", "center": "in the center", "right": "on the right",
    "bottom left": "at the bottom left", "bottom": "at the bottom", "bottom right": "at the bottom right",
}
ACTION_PHRASE = {
    "moving left": "moving to the left", "moving right": "moving to the right", "moving up": "moving up",
    "moving down": "moving down", "spinning": "spinning around", "growing": "growing bigger",
    "shrinking": "shrinking", "bouncing": "bouncing up and down", "changing colour": "changing colour",
    "blinking": "blinking on and off",
}
ORDINALS = ("First", "Second", "Third", "Fourth")

CAPTION_PROMPTS = ("Describe the image briefly.", "Write a short caption for this image.", "What is in the picture?")
DETAIL_PROMPTS = ("Describe the image in detail.", "Give a detailed description of this picture.")
VIDEO_CAPTION_PROMPTS = ("What is happening in the video?", "Describe what happens in the video.")
VIDEO_DETAIL_PROMPTS = ("Describe the video in detail.",)


@dataclass(frozen=True)
class Example:
    """One prompt/answer pair about one scene or clip."""

    task: str  # caption | detail | question | instruction | video_caption | video_detail | video_question
    prompt: str
    answer: str


def _a(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def obj_phrase(o: ToyObject) -> str:
    return f"{_a(o.size)} {o.size} {o.colour} {o.shape}"


def join_words(items: list[str]) -> str:
    if len(items) == 1:
        return items[0]
    return ", ".join(items[:-1]) + " and " + items[-1]


def count_phrase(n: int, noun: str = "object") -> str:
    return f"{NUMBER_WORDS[n]} {noun}{'s' if n != 1 else ''}"


def caption(scene: Scene, style: int) -> str:
    parts = join_words([f"{obj_phrase(o)} {PLACE[o.position]}" for o in scene.objects])
    if style == 0:
        return parts[0].upper() + parts[1:] + "."
    if style == 1:
        return f"This image shows {parts}."
    return f"There {'is' if len(scene.objects) == 1 else 'are'} {count_phrase(len(scene.objects))}: {parts}."


def detailed(scene: Scene, rng: np.random.Generator) -> str:
    n = len(scene.objects)
    s = [f"The image shows {count_phrase(n)} on {_a(scene.background)} {scene.background} {scene.tone} background."]
    for i, o in enumerate(scene.objects):
        lead = ORDINALS[i] if n > 1 else "Here"
        s.append(f"{lead}, {PLACE[o.position]}, there is {obj_phrase(o)}.")
        if rng.random() < 0.5:
            s.append(f"The {o.shape} is {o.colour} and it is {o.size}.")
        else:
            s.append(f"It is {o.size} and its colour is {o.colour}.")
    shapes = Counter(o.shape for o in scene.objects)
    s.append(f"In total there {'is' if n == 1 else 'are'} {count_phrase(n)}: "
             + join_words([count_phrase(k, sh) for sh, k in shapes.items()]) + ".")
    colours = list(dict.fromkeys(o.colour for o in scene.objects))
    s.append(f"The {'colour' if len(colours) == 1 else 'colours'} in the image {'is' if len(colours) == 1 else 'are'} "
             f"{join_words(colours)}.")
    if n > 1:
        big = max(scene.objects, key=lambda o: ("small", "medium", "large").index(o.size))
        s.append(f"The biggest object is the {big.colour} {big.shape} {PLACE[big.position]}.")
    else:
        o = scene.objects[0]
        s.append(f"Nothing else is in the picture, so the {o.colour} {o.shape} is the only thing to look at.")
    return " ".join(s)


def questions(scene: Scene, rng: np.random.Generator) -> list[Example]:
    """A few questions and instructions, each answerable only from the pixels."""
    objs = scene.objects
    n = len(objs)
    out = [Example("question", "How many objects are there?",
                   f"There {'is' if n == 1 else 'are'} {count_phrase(n)}.")]
    shape_counts = Counter(o.shape for o in objs)
    uniq = [o for o in objs if shape_counts[o.shape] == 1]
    if uniq:
        o = uniq[int(rng.integers(len(uniq)))]
        out.append(Example("question", f"What colour is the {o.shape}?", f"The {o.shape} is {o.colour}."))
    cell = int(rng.integers(9))
    here = [o for o in objs if o.cell == cell]
    where = POSITIONS[cell]
    out.append(Example("question", f"What is {PLACE[where]}?",
                       f"There is {obj_phrase(here[0])} {PLACE[where]}." if here else f"There is nothing {PLACE[where]}."))
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    colour = list(COLOURS)[int(rng.integers(len(COLOURS)))]
    if rng.random() < 0.5:  # ask about a present object half of the time
        o = objs[int(rng.integers(n))]
        shape, colour = o.shape, o.colour
    hits = [o for o in objs if o.shape == shape and o.colour == colour]
    out.append(Example("question", f"Is there {_a(colour)} {colour} {shape} in the image?",
                       f"Yes, there is {_a(colour)} {colour} {shape} {PLACE[hits[0].position]}." if hits
                       else f"No, there is no {colour} {shape}."))
    out.append(Example("instruction", "List the objects in the image.",
                       " ".join(f"{i + 1}. {obj_phrase(o)} {PLACE[o.position]}." for i, o in enumerate(objs))))
    colours = list(dict.fromkeys(o.colour for o in objs))
    out.append(Example("instruction", "Name the colours you can see.", join_words(colours).capitalize() + "."))
    hero = objs[0]
    friends = ("It lived alone." if n == 1 else
               f"It had {count_phrase(n - 1, 'friend')}: " + join_words([obj_phrase(o) for o in objs[1:]]) + ".")
    out.append(Example("instruction", "Write a short story about the image.",
                       f"Once upon a time, {obj_phrase(hero)} lived {PLACE[hero.position]}. {friends} "
                       f"Every day the {hero.shape} looked at the {scene.tone} sky and smiled. The end."))
    return out


def scene_examples(scene: Scene, rng: np.random.Generator, n_questions: int = 2) -> list[Example]:
    """One caption, one detailed description and `n_questions` questions/instructions for a scene."""
    style = int(rng.integers(len(CAPTION_PROMPTS)))
    ex = [Example("caption", CAPTION_PROMPTS[style], caption(scene, style)),
          Example("detail", DETAIL_PROMPTS[int(rng.integers(len(DETAIL_PROMPTS)))], detailed(scene, rng))]
    qs = questions(scene, rng)
    pick = rng.choice(len(qs), size=min(n_questions, len(qs)), replace=False)
    return ex + [qs[int(i)] for i in pick]


def clip_caption(clip: Clip) -> str:
    return f"{_a(clip.colour).capitalize()} {clip.colour} {clip.shape} is {ACTION_PHRASE[clip.action]}."


def clip_detailed(clip: Clip) -> str:
    s = [f"The video shows {_a(clip.colour)} {clip.colour} {clip.shape} on a plain {clip.tone} background.",
         f"The {clip.shape} is {ACTION_PHRASE[clip.action]}."]
    if clip.action == "changing colour":
        s.append(f"It starts {clip.colour} and turns {clip.colour2}.")
    elif clip.action.startswith("moving"):
        s.append(f"It keeps {ACTION_PHRASE[clip.action]} until the end of the clip.")
    else:
        s.append(f"It stays in the same place while it is {ACTION_PHRASE[clip.action]}.")
    s.append(f"The action in this clip is {clip.action}.")
    return " ".join(s)


def clip_examples(clip: Clip, rng: np.random.Generator) -> list[Example]:
    colour_answer = (f"The {clip.shape} changes from {clip.colour} to {clip.colour2}." if clip.colour != clip.colour2
                     else f"The {clip.shape} is {clip.colour}.")
    qs = [Example("video_question", "What action is shown in this clip?", f"The action is {clip.action}."),
          Example("video_question", "What colour is the object in the video?", colour_answer)]
    return [
        Example("video_caption", VIDEO_CAPTION_PROMPTS[int(rng.integers(len(VIDEO_CAPTION_PROMPTS)))], clip_caption(clip)),
        Example("video_detail", VIDEO_DETAIL_PROMPTS[0], clip_detailed(clip)),
        qs[int(rng.integers(len(qs)))],
    ]
