"""The small world the miniature's texts talk about: people, towns, attributes, and scenes rendered from templates.

Pretraining (`pretrain.py`) and the held-out instruction suite (`tasks.py`) draw scenes from the same generators but
with disjoint people and towns (`entities("pretrain")` / `entities("heldout")`) and their own sentence templates, so
the suite tests what tuning adds on top of pretraining, not recall of pretraining text.

Everything is deterministic: randomness comes only from the `random.Random` a caller passes in, and the entity split
is a fixed shuffle of a sorted list (never Python's per-process `hash`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import cache

CONSONANTS = "bdfgklmnprstvz"
VOWELS = "aeiou"
TOWN_ENDINGS = ("ton", "dor", "mar", "vik")

COLORS = ("red", "blue", "green", "yellow", "black", "white", "brown", "pink", "gray", "orange")
ANIMALS = ("cat", "dog", "horse", "bird", "goat", "sheep", "mouse", "rabbit", "duck", "cow", "fox", "frog")
JOBS = ("baker", "farmer", "teacher", "doctor", "singer", "painter", "driver", "sailor", "cook", "writer", "nurse")
FOODS = ("apples", "bread", "rice", "soup", "cheese", "cake", "pears", "plums", "honey", "corn", "beans", "nuts")
THINGS = ("a hat", "a cup", "a book", "a lamp", "a rope", "a pen", "a bell", "a key", "a map", "a coin", "a box",
          "a shoe", "a comb", "a kite", "a drum", "a vase")
COUNTABLE = ("apples", "books", "coins", "cups", "hats", "pens", "boxes", "stones", "shells", "eggs", "keys", "cards")
# (comparative, superlative) of one scale and of its opposite.
SCALES = (
    (("taller", "tallest"), ("shorter", "shortest")),
    (("older", "oldest"), ("younger", "youngest")),
    (("faster", "fastest"), ("slower", "slowest")),
    (("heavier", "heaviest"), ("lighter", "lightest")),
    (("stronger", "strongest"), ("weaker", "weakest")),
)
# Words of each category, without an article ("hat", not "a hat"): the category questions ask what kind of word it is.
CATEGORIES = {
    "animal": ANIMALS,
    "food": FOODS,
    "color": COLORS,
    "job": JOBS,
    "object": tuple(thing.split(" ", 1)[1] for thing in THINGS),
}
ORDINALS = ("first", "second", "third", "fourth", "fifth")
HELDOUT_FRACTION = 0.2


@dataclass(frozen=True)
class Entities:
    """The people and towns of one part of the world."""

    people: tuple[str, ...]
    towns: tuple[str, ...]


def _syllables() -> list[str]:
    return [c + v for c in CONSONANTS for v in VOWELS]


def _split(names: list[str], part: str, seed: int) -> tuple[str, ...]:
    shuffled = sorted(names)
    random.Random(seed).shuffle(shuffled)
    cut = int(len(shuffled) * HELDOUT_FRACTION)
    return tuple(shuffled[cut:] if part == "pretrain" else shuffled[:cut])


@cache
def entities(part: str) -> Entities:
    """People (two syllables, "Kalo") and towns (two syllables and an ending, "Miradon"), split 80/20 by part."""
    if part not in ("pretrain", "heldout"):
        raise ValueError(f"`part` must be 'pretrain' or 'heldout', got {part!r}.")
    syllables = _syllables()
    people = [(a + b).capitalize() for a in syllables for b in syllables if a != b]
    towns = [(a + b[0] + ending).capitalize() for a in syllables for b in syllables[::7] for ending in TOWN_ENDINGS]
    return Entities(people=_split(people, part, seed=11), towns=_split(towns, part, seed=12))


# ---------------------------------------------------------------- scenes: the content of a passage, before wording
@dataclass(frozen=True)
class FactScene:
    """Each person has one value of the same attribute kind (town, color, animal, job, food)."""

    kind: str
    people: tuple[str, ...]
    values: tuple[str, ...]


@dataclass(frozen=True)
class ListScene:
    """One person's items, in order."""

    person: str
    items: tuple[str, ...]


@dataclass(frozen=True)
class CompareScene:
    """People ordered from most to least on a scale; `pairs` are the stated comparisons (greater, lesser)."""

    scale: tuple[tuple[str, str], tuple[str, str]]
    ranking: tuple[str, ...]
    pairs: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class CountScene:
    """Each person has a count of the same countable things."""

    thing: str
    people: tuple[str, ...]
    counts: tuple[int, ...]


@dataclass(frozen=True)
class WordScene:
    """One person and one word of a category."""

    person: str
    category: str
    word: str


ATTRIBUTE_KINDS = ("town", "color", "animal", "job", "food")


def fact_scene(rng: random.Random, world: Entities, size: int) -> FactScene:
    kind = rng.choice(ATTRIBUTE_KINDS)
    pool = {"town": world.towns, "color": COLORS, "animal": ANIMALS, "job": JOBS, "food": FOODS}[kind]
    return FactScene(kind, tuple(rng.sample(world.people, size)), tuple(rng.sample(pool, size)))


def list_scene(rng: random.Random, world: Entities, size: int) -> ListScene:
    return ListScene(rng.choice(world.people), tuple(rng.sample(THINGS, size)))


def word_scene(rng: random.Random, world: Entities) -> WordScene:
    category = rng.choice(list(CATEGORIES))
    return WordScene(rng.choice(world.people), category, rng.choice(CATEGORIES[category]))


def compare_scene(rng: random.Random, world: Entities, size: int) -> CompareScene:
    """A chain of `size` people; the `size - 1` adjacent comparisons are stated in a random order and direction."""
    ranking = tuple(rng.sample(world.people, size))
    pairs = [(ranking[i], ranking[i + 1]) for i in range(size - 1)]
    rng.shuffle(pairs)
    return CompareScene(rng.choice(SCALES), ranking, tuple(pairs))


def count_scene(rng: random.Random, world: Entities, size: int, low: int = 1, high: int = 9) -> CountScene:
    counts = tuple(rng.randint(low, high) for _ in range(size))
    return CountScene(rng.choice(COUNTABLE), tuple(rng.sample(world.people, size)), counts)


def comparison_sentence(
    rng: random.Random, scale, greater: str, lesser: str, forms=("{a} is {cmp} than {b}.",)
) -> str:
    """`greater` is more on the scale: said either way round ("A is taller than B" or "B is shorter than A")."""
    (more, _), (less, _) = scale
    form = rng.choice(forms)
    if rng.random() < 0.5:
        return form.format(a=greater, cmp=more, b=lesser)
    return form.format(a=lesser, cmp=less, b=greater)


def join_items(items: tuple[str, ...] | list[str]) -> str:
    """"a, b, c and d"."""
    return ", ".join(items[:-1]) + " and " + items[-1] if len(items) > 1 else items[0]
