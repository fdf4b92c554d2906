"""
Pretrain the miniature's base model: a ~1M-parameter Llama on a corpus this script generates, in ~15 minutes on a CPU.

The corpus mixes plain text-like documents (passages about people, their towns, pets, jobs, food, shopping lists,
counts, comparisons and written words; arithmetic sentences; "frog is a kind of animal." sentences), lists repeated
after `Again:` (copying is what a model this small learns last, and the rest needs it), and question/answer documents
over such passages (facts, lists, membership, counts, comparisons, categories, sums), the question sometimes before
and sometimes after the passage. The held-out instruction suite (`tasks.py`) uses other people and other wordings, so
tuning has something to teach.

    python examples/miniature/pretrain.py --output_dir examples/miniature/base --seed 0

writes `save_pretrained` safetensors and a `PreTrainedTokenizerFast` (byte-level BPE built with `tokenizers`; `<s>`
is prepended to every encoded text, `</s>` ends a document, `<pad>` pads on the left for generation).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

if str(Path(__file__).parent) not in sys.path:  # the sibling modules, also when imported from elsewhere
    sys.path.insert(0, str(Path(__file__).parent))
import world  # noqa: E402
from world import ORDINALS, CompareScene, CountScene, FactScene, ListScene  # noqa: E402

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")

# ---------------------------------------------------------------- pretraining wordings (tasks.py uses others)
FACT_SENTENCES = {
    "town": "{p} lives in {v}.",
    "color": "The favorite color of {p} is {v}.",
    "animal": "{p} has a pet {v}.",
    "job": "{p} works as a {v}.",
    "food": "{p} likes to eat {v}.",
}
FACT_QUESTIONS = {
    "town": "Where does {p} live?",
    "color": "What is the favorite color of {p}?",
    "animal": "What pet does {p} have?",
    "job": "What does {p} work as?",
    "food": "What does {p} like to eat?",
}
FACT_REVERSE_QUESTIONS = {
    "town": "Who lives in {v}?",
    "color": "Whose favorite color is {v}?",
    "animal": "Who has a pet {v}?",
    "job": "Who works as a {v}?",
    "food": "Who likes to eat {v}?",
}
# (passage header, question header, answer header): question first or passage first.
QA_LAYOUTS = (
    ("Text:", "Question:", "Answer:"),
    ("Passage:", "Q:", "A:"),
    ("", "Question:", "Answer:"),
)


def fact_passage(scene: FactScene) -> str:
    return " ".join(FACT_SENTENCES[scene.kind].format(p=p, v=v) for p, v in zip(scene.people, scene.values))


def fact_questions(rng: random.Random, scene: FactScene) -> list[tuple[str, str]]:
    i = rng.randrange(len(scene.people))
    p, v = scene.people[i], scene.values[i]
    return [(FACT_QUESTIONS[scene.kind].format(p=p), v), (FACT_REVERSE_QUESTIONS[scene.kind].format(v=v), p)]


def list_passage(scene: ListScene) -> str:
    return f"{scene.person} bought {world.join_items(scene.items)}."


def list_questions(rng: random.Random, scene: ListScene) -> list[tuple[str, str]]:
    items, p = scene.items, scene.person
    i = rng.randrange(len(items))
    j = rng.randrange(len(items) - 1)
    asked = rng.choice(items) if rng.random() < 0.5 else rng.choice([t for t in world.THINGS if t not in items])
    return [
        (f"What did {p} buy {ORDINALS[i]}?", items[i]),
        (f"What did {p} buy after {items[j]}?", items[j + 1]),
        (f"What did {p} buy before {items[j + 1]}?", items[j]),
        (f"How many things did {p} buy?", str(len(items))),
        (f"What did {p} buy last?", items[-1]),
        (f"Did {p} buy {asked}?", "yes" if asked in items else "no"),
    ]


def word_passage(scene: world.WordScene) -> str:
    return f"{scene.person} wrote the word {scene.word}."


def word_questions(scene: world.WordScene) -> list[tuple[str, str]]:
    return [(f"What kind of word did {scene.person} write?", scene.category),
            (f"Which word did {scene.person} write?", scene.word)]


def category_sentence(rng: random.Random) -> str:
    """Knowledge the category questions rely on: "frog is a kind of animal."."""
    category = rng.choice(list(world.CATEGORIES))
    return f"{rng.choice(world.CATEGORIES[category])} is a kind of {category}."


def compare_passage(rng: random.Random, scene: CompareScene) -> str:
    return " ".join(world.comparison_sentence(rng, scene.scale, a, b) for a, b in scene.pairs)


def compare_questions(rng: random.Random, scene: CompareScene) -> list[tuple[str, str]]:
    (more, most), (less, least) = scene.scale
    r = scene.ranking
    a, b = rng.sample(r, 2)
    return [
        (f"Who is the {most}?", r[0]),
        (f"Who is the {least}?", r[-1]),
        (f"Is {a} {more} than {b}?", "yes" if r.index(a) < r.index(b) else "no"),
        (f"Who is {less}, {a} or {b}?", a if r.index(a) > r.index(b) else b),
    ]


def count_passage(scene: CountScene) -> str:
    return " ".join(f"{p} has {n} {scene.thing}." for p, n in zip(scene.people, scene.counts))


def count_questions(rng: random.Random, scene: CountScene) -> list[tuple[str, str]]:
    (a, b), (n, m) = scene.people[:2], scene.counts[:2]
    i = rng.randrange(len(scene.people))
    questions = [
        (f"How many {scene.thing} does {scene.people[i]} have?", str(scene.counts[i])),
        (f"How many {scene.thing} do {a} and {b} have together?", str(n + m)),
    ]
    if n != m:
        questions.append((f"Who has more {scene.thing}, {a} or {b}?", a if n > m else b))
    return questions


def arithmetic_sentence(rng: random.Random) -> str:
    n, m = rng.randint(0, 20), rng.randint(0, 20)
    if rng.random() < 0.6:
        return f"{n} plus {m} is {n + m}."
    n, m = max(n, m), min(n, m)
    return f"{n} minus {m} is {n - m}."


def arithmetic_question(rng: random.Random) -> tuple[str, str]:
    n, m = rng.randint(0, 20), rng.randint(0, 20)
    if rng.random() < 0.6:
        return f"What is {n} plus {m}?", str(n + m)
    n, m = max(n, m), min(n, m)
    return f"What is {n} minus {m}?", str(n - m)


def random_passage(rng: random.Random, people: world.Entities) -> tuple[str, list[tuple[str, str]]]:
    """One passage of a random type, with the questions it answers."""
    kind = rng.choice(("fact", "list", "list", "compare", "count", "count", "word"))
    if kind == "word":
        scene = world.word_scene(rng, people)
        return word_passage(scene), word_questions(scene)
    if kind == "fact":
        scene = world.fact_scene(rng, people, rng.randint(2, 4))
        return fact_passage(scene), fact_questions(rng, scene)
    if kind == "list":
        scene = world.list_scene(rng, people, rng.randint(2, 5))
        return list_passage(scene), list_questions(rng, scene)
    if kind == "compare":
        scene = world.compare_scene(rng, people, rng.randint(3, 4))
        return compare_passage(rng, scene), compare_questions(rng, scene)
    scene = world.count_scene(rng, people, rng.randint(2, 3), low=2)
    return count_passage(scene), count_questions(rng, scene)


def text_document(rng: random.Random, people: world.Entities) -> str:
    """Plain text: a few passages and arithmetic sentences, no questions."""
    parts = []
    for _ in range(rng.randint(2, 4)):
        draw = rng.random()
        if draw < 0.2:
            parts.append(arithmetic_sentence(rng))
        elif draw < 0.4:
            parts.append(category_sentence(rng))
        else:
            parts.append(random_passage(rng, people)[0])
    return " ".join(parts)


def repeat_document(rng: random.Random, people: world.Entities) -> str:
    """A list of names and words, then the same list again: the cheapest lesson in looking back and copying."""
    pools = (people.people, people.towns, world.COLORS, world.ANIMALS, world.JOBS, world.FOODS)
    words = [rng.choice(rng.choice(pools)) for _ in range(rng.randint(4, 10))]
    return " ".join(words) + ".\nAgain: " + " ".join(words) + "."


def qa_document(rng: random.Random, people: world.Entities, max_questions: int) -> str:
    """
    A passage and questions about it: one question before the passage, or up to `max_questions` after it (more
    answers per token teach looking things up sooner); a bare sum needs no passage.
    """
    if rng.random() < 0.1:
        question, answer = arithmetic_question(rng)
        return f"Question: {question}\nAnswer: {answer}"
    passage, questions = random_passage(rng, people)
    passage_header, question_header, answer_header = rng.choice(QA_LAYOUTS)
    passage_line = f"{passage_header} {passage}".strip()
    if rng.random() < 0.5:
        question, answer = rng.choice(questions)
        return f"{question_header} {question}\n{passage_line}\n{answer_header} {answer}"
    lines = [passage_line]
    for question, answer in rng.sample(questions, rng.randint(1, min(max_questions, len(questions)))):
        lines += [f"{question_header} {question}", f"{answer_header} {answer}"]
    return "\n".join(lines)


def generate_corpus(
    num_documents: int,
    seed: int,
    text_fraction: float = 0.15,
    repeat_fraction: float = 0.15,
    max_questions: int = 3,
) -> list[str]:
    """
    The pretraining documents: plain text (`text_fraction`), repeated lists (`repeat_fraction`), and question/answer
    documents (the rest); pretraining people and towns only.
    """
    rng = random.Random(seed)
    people = world.entities("pretrain")
    kinds = (
        (text_fraction, text_document),
        (repeat_fraction, repeat_document),
    )
    documents = []
    for _ in range(num_documents):
        draw = rng.random()
        for fraction, make in kinds:
            if draw < fraction:
                documents.append(make(rng, people))
                break
            draw -= fraction
        else:
            documents.append(qa_document(rng, people, max_questions))
    return documents


# ---------------------------------------------------------------- tokenizer and model
def build_tokenizer(corpus: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE (any text encodes, unseen names split into pieces); `<s>` prepended to every encoding."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    bos = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", bos)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>", padding_side="left",
        model_max_length=256,
    )


def model_config(tokenizer: PreTrainedTokenizerFast, num_layers: int = 4) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=384, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )


def pack(corpus: list[str], tokenizer: PreTrainedTokenizerFast, block_size: int) -> torch.Tensor:
    """`<s> document </s>` one after another, cut into blocks (the last partial block is dropped)."""
    ids: list[int] = []
    for encoded in tokenizer(corpus)["input_ids"]:
        ids.extend(encoded + [tokenizer.eos_token_id])
    blocks = len(ids) // block_size
    return torch.tensor(ids[: blocks * block_size]).view(blocks, block_size)


def learning_rate(step: int, steps: int, peak: float, warmup: int, decay_fraction: float) -> float:
    """
    Linear warmup, constant, then cosine decay to a tenth of the peak over the last `decay_fraction` of the steps. The
    long constant phase matters: looking things up in context (induction) appears only after a plateau, and an early
    decay stalls it.
    """
    if step < warmup:
        return peak * (step + 1) / warmup
    decay_start = steps - int(decay_fraction * steps)
    if step < decay_start:
        return peak
    progress = (step - decay_start) / max(1, steps - decay_start)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def pretrain(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    start = time.time()
    corpus = generate_corpus(
        args.documents, args.seed, args.text_fraction, args.repeat_fraction, args.max_questions
    )
    tokenizer = build_tokenizer(corpus, args.vocab_size)
    blocks = pack(corpus, tokenizer, args.block_size)
    config = model_config(tokenizer, args.num_layers)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    parameters = sum(p.numel() for p in model.parameters())
    print(f"{len(corpus)} documents, {blocks.numel()} tokens in {len(blocks)} blocks, vocabulary {len(tokenizer)}, "
          f"{parameters} parameters; {args.steps} steps of {args.batch_size} blocks = "
          f"{args.steps * args.batch_size / len(blocks):.2f} epochs", flush=True)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.0, betas=(0.9, 0.95))
    order = torch.Generator().manual_seed(args.seed)
    permutation = torch.randperm(len(blocks), generator=order)
    cursor, running = 0, None
    model.train()
    for step in range(args.steps):
        if cursor + args.batch_size > len(permutation):
            permutation, cursor = torch.randperm(len(blocks), generator=order), 0
        batch = blocks[permutation[cursor : cursor + args.batch_size]]
        cursor += args.batch_size
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(
                step, args.steps, args.learning_rate, args.warmup_steps, args.decay_fraction
            )
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        running = loss.item() if running is None else 0.95 * running + 0.05 * loss.item()
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step:5d}  loss {running:.3f}  {time.time() - start:6.0f}s", flush=True)

    output = Path(args.output_dir)
    model.eval()
    model.save_pretrained(output, safe_serialization=True)
    tokenizer.save_pretrained(output)
    provenance = {
        "command": "python examples/miniature/pretrain.py " + " ".join(sys.argv[1:]),
        "arguments": vars(args),
        "parameters": parameters,
        "tokens_seen": args.steps * args.batch_size * args.block_size,
        "final_loss": running,
        "seconds": round(time.time() - start),
        "torch": torch.__version__,
    }
    (output / "pretraining.json").write_text(json.dumps(provenance, indent=2) + "\n")
    print(f"saved to {output} after {time.time() - start:.0f}s", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[1], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--output_dir", default=str(Path(__file__).parent / "base"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--documents", type=int, default=100_000, help="documents in the generated corpus")
    parser.add_argument("--text_fraction", type=float, default=0.15, help="share of plain-text documents")
    parser.add_argument("--repeat_fraction", type=float, default=0.15, help="share of repeated-list documents")
    parser.add_argument("--max_questions", type=int, default=3, help="most questions after one passage")
    parser.add_argument("--vocab_size", type=int, default=1024)
    parser.add_argument("--block_size", type=int, default=128)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--learning_rate", type=float, default=3e-3)
    parser.add_argument("--warmup_steps", type=int, default=100)
    parser.add_argument("--decay_fraction", type=float, default=0.3, help="share of the steps spent decaying the rate")
    parser.add_argument("--num_layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads; 1 is fastest for a model this small when other work shares the cores")
    return parser.parse_args(argv)


if __name__ == "__main__":
    pretrain(parse_args())
