"""
The miniature's held-out instruction-tuning suite: four multiple-choice tasks and one short-generation task.

Passages are drawn like the pretraining corpus's (`world.py`) but about people the base never saw, in sentence and
question wordings it never saw, inside an instruction layout it never saw. Every row is in TRL's prompt-completion
form: the prompt is the instruction and ends with `Answer:`, the completion is the answer with a leading space (paper,
A.10). The question comes before the passage in half of the rows and after it in the other half (`question_first`).

| task         | kind            | asks                                                | choices             |
|--------------|-----------------|-----------------------------------------------------|---------------------|
| `membership` | multiple choice | whether a given item is in a packed bag             | yes / no            |
| `count`      | multiple choice | how many items are in the bag                       | 2, 3, 4, 5          |
| `position`   | multiple choice | which item went into the bag first / last           | the items           |
| `category`   | multiple choice | what kind of word a person said (animal, food, ...) | the five categories |
| `sum`        | generation      | the total of two people's counts                    | exact match         |

Two more tasks, of the paper's other kinds, join them for the real-model experiment (`examples/smollm2/run.py`); the
miniature's own experiment and committed data keep the five above:

| task         | kind            | asks                                                | choices / scoring      |
|--------------|-----------------|-----------------------------------------------------|------------------------|
| `options`    | multiple choice | which of four listed items is in the bag            | `(0)` ... `(3)`        |
| `cot_sum`    | generation      | the total of two of three people's counts           | final number, by value |

In `options`, the question and its numbered options come as one block (before the story in half of the rows),
answered by the option's number, as the paper's SIQA/MMLU formats; `cot_sum` is answered with chain-of-thought steps
then `#### <number>` (A.9).

Multiple-choice tasks are scored by the log-likelihood of each choice as the answer (as the paper's zero-shot tasks);
`sum` by exact match of the greedy answer. (Tasks that bind attributes to people among several, "what does Kalo
eat?", were tried first and left out: no base this small learned them within the pretraining budget, nor did any
tuning, so they only added noise; see docs/miniature.md.)

    python examples/miniature/tasks.py --write_data examples/miniature/data

writes `train.jsonl` and `test.jsonl` there (the committed copy, which `datasets.load_dataset("json", ...)` reads).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

if str(Path(__file__).parent) not in sys.path:  # the sibling modules, also when imported from elsewhere
    sys.path.insert(0, str(Path(__file__).parent))
import world  # noqa: E402

from peft_bitune.evaluation.answers import format_cot_answer  # noqa: E402

MULTIPLE_CHOICE_TASKS = ("membership", "count", "position", "category")
TASKS = MULTIPLE_CHOICE_TASKS + ("sum",)  # the miniature's suite
PAPER_KIND_TASKS = ("options", "cot_sum")  # listed options answered by number (A.10), chain of thought (A.9)
ALL_TASKS = TASKS + PAPER_KIND_TASKS
GENERATION_TASKS = ("sum", "cot_sum")
TRAIN_SEED, VALIDATION_SEED, TEST_SEED = 101, 202, 303
DATA_SIZES = {"train": 300, "test": 200}  # rows per task in the committed JSONL files
COUNT_CHOICES = ("2", "3", "4", "5")


@dataclass(frozen=True)
class Example:
    """One instruction and its answer; `choices` (without the leading space) and `label` for multiple choice."""

    task: str
    prompt: str
    completion: str
    choices: tuple[str, ...]
    label: int
    question_first: bool

    @property
    def is_multiple_choice(self) -> bool:
        return bool(self.choices)


def instruction(passage: str, question: str, question_first: bool) -> str:
    if question_first:
        return f"Ask: {question}\nStory: {passage}\nAnswer:"
    return f"Read the story and answer.\nStory: {passage}\nAsk: {question}\nAnswer:"


def _bag(rng: random.Random, people: world.Entities) -> world.ListScene:
    return world.list_scene(rng, people, rng.randint(2, 5))


def _bag_passage(scene: world.ListScene) -> str:
    return f"{scene.person} packed {world.join_items(scene.items)} into a bag."


def _membership(rng: random.Random, people: world.Entities) -> tuple[str, str, list[str], int]:
    scene = _bag(rng, people)
    inside = rng.random() < 0.5
    asked = rng.choice(scene.items) if inside else rng.choice([t for t in world.THINGS if t not in scene.items])
    return _bag_passage(scene), f"Is there {asked} in the bag?", ["yes", "no"], 0 if inside else 1


def _count(rng: random.Random, people: world.Entities) -> tuple[str, str, list[str], int]:
    scene = _bag(rng, people)
    return _bag_passage(scene), "How many things are in the bag?", list(COUNT_CHOICES), COUNT_CHOICES.index(
        str(len(scene.items))
    )


def _position(rng: random.Random, people: world.Entities) -> tuple[str, str, list[str], int]:
    scene = _bag(rng, people)
    if rng.random() < 0.5:
        return _bag_passage(scene), "What went into the bag first?", list(scene.items), 0
    return _bag_passage(scene), "What went into the bag last?", list(scene.items), len(scene.items) - 1


def _category(rng: random.Random, people: world.Entities) -> tuple[str, str, list[str], int]:
    scene = world.word_scene(rng, people)
    categories = list(world.CATEGORIES)
    passage = f"{scene.person} said the word {scene.word} out loud."
    return passage, f"What kind of thing did {scene.person} name?", categories, categories.index(scene.category)


def _sum(rng: random.Random, people: world.Entities) -> tuple[str, str, str]:
    scene = world.count_scene(rng, people, 2, low=2)
    (a, b), (n, m), thing = scene.people, scene.counts, scene.thing
    passage = f"{a} collected {n} {thing}. {b} collected {m} {thing}."
    return passage, f"How many {thing} did the two of them collect in all?", str(n + m)


def _options(rng: random.Random, people: world.Entities) -> tuple[str, str, list[str], int]:
    scene = _bag(rng, people)
    inside = rng.choice(scene.items)
    listed = rng.sample([t for t in world.THINGS if t not in scene.items], 3)
    label = rng.randrange(4)
    listed.insert(label, inside)
    question = "Which of these is in the bag?\n" + "\n".join(f"({i}) {item}" for i, item in enumerate(listed))
    return _bag_passage(scene), question, [f"({i})" for i in range(4)], label


def _cot_sum(rng: random.Random, people: world.Entities) -> tuple[str, str, str]:
    scene = world.count_scene(rng, people, 3, low=2)
    passage = " ".join(
        f"{person} collected {count} {scene.thing}." for person, count in zip(scene.people, scene.counts)
    )
    first, second = sorted(rng.sample(range(3), 2))
    (a, n), (b, m) = (scene.people[first], scene.counts[first]), (scene.people[second], scene.counts[second])
    steps = [f"{a} collected {n} {scene.thing}.", f"{b} collected {m} {scene.thing}.", f"{n} + {m} = {n + m}."]
    return passage, f"How many {scene.thing} did {a} and {b} collect together?", format_cot_answer(steps, str(n + m))


MULTIPLE_CHOICE_BUILDERS = {"membership": _membership, "count": _count, "position": _position, "category": _category,
                            "options": _options}
GENERATION_BUILDERS = {"sum": _sum, "cot_sum": _cot_sum}


def make_example(task: str, rng: random.Random, people: world.Entities) -> Example:
    question_first = rng.random() < 0.5
    if task in MULTIPLE_CHOICE_BUILDERS:
        passage, question, choices, label = MULTIPLE_CHOICE_BUILDERS[task](rng, people)
        answer = choices[label]
    elif task in GENERATION_BUILDERS:
        passage, question, answer = GENERATION_BUILDERS[task](rng, people)
        choices, label = [], -1
    else:
        raise ValueError(f"Unknown task {task!r}; the tasks are {', '.join(ALL_TASKS)}.")
    return Example(task, instruction(passage, question, question_first), " " + answer, tuple(choices), label,
                   question_first)


def make_split(split: str, rows_per_task: int, tasks: tuple[str, ...] = TASKS) -> list[Example]:
    """`rows_per_task` rows of each task, interleaved; the splits use different seeds, so rows rarely repeat."""
    seeds = {"train": TRAIN_SEED, "validation": VALIDATION_SEED, "test": TEST_SEED}
    if split not in seeds:
        raise ValueError(f"`split` must be one of {', '.join(seeds)}, got {split!r}.")
    rng = random.Random(seeds[split])
    people = world.entities("heldout")
    return [make_example(task, rng, people) for _ in range(rows_per_task) for task in tasks]


def write_jsonl(examples: list[Example], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        for example in examples:
            handle.write(json.dumps(asdict(example)) + "\n")


def write_data(directory: Path) -> dict[str, Path]:
    """The committed copy of the suite: `train.jsonl` and `test.jsonl` (prompt, completion, task, choices, ...)."""
    paths = {}
    for split, rows in DATA_SIZES.items():
        paths[split] = directory / f"{split}.jsonl"
        write_jsonl(make_split(split, rows), paths[split])
    return paths


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Write the held-out suite as JSONL files.")
    parser.add_argument("--write_data", required=True, help="directory for train.jsonl and test.jsonl")
    for split, path in write_data(Path(parser.parse_args().write_data)).items():
        print(f"{split}: {path}")
