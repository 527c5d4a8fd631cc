"""Arithmetic word problems generated offline: the default task for small instruct models.

Deterministic for a (seed, split, difficulty): every split draws from its own random stream,
and the question space is partitioned by a hash of the question text, so train and val never
share a question whatever their seeds and sizes. The few-shot example question is in neither.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass

from grouprl.data.sample import Sample
from grouprl.errors import ConfigError

# Short on purpose: with the example turn, a prompt is 106-116 SmolLM2 tokens in ChatML.
SYSTEM_PROMPT = "Think briefly in <think></think>, then give only the final number in <answer></answer>."
EXAMPLE_QUESTION = "Tom has 7 apples and buys 5 more. How many apples does Tom have now?"
EXAMPLE_ANSWER = "<think>7 + 5 = 12</think>\n<answer>12</answer>"
DATA_SOURCE = "grouprl/arithmetic"
SPLITS = ("train", "val")
VAL_SHARE = 8  # one question in VAL_SHARE (by text hash) belongs to val, the rest to train

NAMES = (
    "Tom",
    "Anna",
    "Ben",
    "Mia",
    "Sam",
    "Lily",
    "Omar",
    "Priya",
    "Leo",
    "Zoe",
    "Ravi",
    "Emma",
    "Kenji",
    "Nora",
)
OBJECTS = (
    "apples",
    "pencils",
    "stickers",
    "marbles",
    "books",
    "cookies",
    "coins",
    "shells",
    "cards",
    "stamps",
)


@dataclass(frozen=True)
class Template:
    """A question shape: `draw` picks (a, b, c) for a difficulty, `solve` gives the answer."""

    kind: str
    text: str  # str.format fields: name, obj, a, b, c
    expression: str  # the same computation as python arithmetic, kept for checking
    draw: Callable[[random.Random, int], tuple[int, int, int]]
    solve: Callable[[int, int, int], int]
    min_difficulty: int = 1


def _draw_sum(rng: random.Random, difficulty: int) -> tuple[int, int, int]:
    low, high = {1: (2, 50), 2: (10, 250), 3: (100, 999)}[difficulty]  # difficulty 1: sum <= 100
    return rng.randint(low, high), rng.randint(low, high), 0


def _draw_difference(rng: random.Random, difficulty: int) -> tuple[int, int, int]:
    high = {1: 100, 2: 500, 3: 1000}[difficulty]
    a = rng.randint(10, high)
    return a, rng.randint(2, a - 1), 0


def _draw_product(rng: random.Random, difficulty: int) -> tuple[int, int, int]:
    (a_low, a_high), (b_low, b_high) = {1: ((2, 10), (2, 10)), 2: ((2, 12), (2, 25)), 3: ((3, 25), (10, 50))}[
        difficulty
    ]
    return rng.randint(a_low, a_high), rng.randint(b_low, b_high), 0


def _draw_sum_then_difference(rng: random.Random, difficulty: int) -> tuple[int, int, int]:
    a, b, _ = _draw_sum(rng, difficulty)
    return a, b, rng.randint(2, a + b - 1)


def _draw_product_then_sum(rng: random.Random, difficulty: int) -> tuple[int, int, int]:
    a, b, _ = _draw_product(rng, difficulty)
    return a, b, rng.randint(2, 20 * difficulty)


TEMPLATES = (
    Template(
        "add",
        "{name} has {a} {obj} and buys {b} more. How many {obj} does {name} have now?",
        "{a} + {b}",
        _draw_sum,
        lambda a, b, c: a + b,
    ),
    Template(
        "add",
        "{name} found {a} {obj} in the morning and {b} in the afternoon. How many {obj} did {name} find in total?",
        "{a} + {b}",
        _draw_sum,
        lambda a, b, c: a + b,
    ),
    Template(
        "subtract",
        "{name} had {a} {obj} and gave {b} to a friend. How many {obj} does {name} have left?",
        "{a} - {b}",
        _draw_difference,
        lambda a, b, c: a - b,
    ),
    Template(
        "subtract",
        "A box held {a} {obj}. {name} took {b} out. How many {obj} are in the box now?",
        "{a} - {b}",
        _draw_difference,
        lambda a, b, c: a - b,
    ),
    Template(
        "multiply",
        "{name} buys {a} bags with {b} {obj} in each bag. How many {obj} does {name} buy?",
        "{a} * {b}",
        _draw_product,
        lambda a, b, c: a * b,
    ),
    Template(
        "multiply",
        "A shelf has {a} rows of {b} {obj}. How many {obj} are on the shelf?",
        "{a} * {b}",
        _draw_product,
        lambda a, b, c: a * b,
    ),
    Template(
        "add_subtract",
        "{name} has {a} {obj}, gets {b} more, then gives away {c}. How many {obj} does {name} have now?",
        "{a} + {b} - {c}",
        _draw_sum_then_difference,
        lambda a, b, c: a + b - c,
        min_difficulty=2,
    ),
    Template(
        "multiply_add",
        "{name} buys {a} packs of {b} {obj} and already had {c}. How many {obj} does {name} have in total?",
        "{a} * {b} + {c}",
        _draw_product_then_sum,
        lambda a, b, c: a * b + c,
        min_difficulty=2,
    ),
)


def split_of(question: str) -> str:
    """The split a question belongs to, fixed by its text alone."""
    bucket = int(hashlib.sha1(question.encode("utf-8")).hexdigest()[:8], 16) % VAL_SHARE
    return "val" if bucket == 0 else "train"


def arithmetic_messages(question: str, *, few_shot: bool = True) -> list[dict[str, str]]:
    """System instruction, optionally one worked example, then the question (~100 tokens in all)."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    if few_shot:
        messages += [
            {"role": "user", "content": EXAMPLE_QUESTION},
            {"role": "assistant", "content": EXAMPLE_ANSWER},
        ]
    messages.append({"role": "user", "content": question})
    return messages


def make_arithmetic(
    n: int, seed: int, split: str = "train", *, few_shot: bool = True, difficulty: int = 1
) -> list[Sample]:
    """`n` distinct word problems of `split` ("train" or "val"); the same arguments give the same list.

    difficulty 1: one addition, subtraction or multiplication of small numbers (answers 1..100);
    2: larger numbers and two-step problems; 3: larger still. uid: `arith-<split>-<index:05d>`.
    """
    if split not in SPLITS:
        raise ConfigError(f"arithmetic split must be one of {', '.join(SPLITS)}, got {split!r}")
    if difficulty not in (1, 2, 3):
        raise ConfigError(f"arithmetic difficulty must be 1, 2 or 3, got {difficulty}")
    if n < 0:
        raise ConfigError(f"arithmetic needs n >= 0 problems, got {n}")
    # A string seed is hashed with sha512 by random.Random: stable across runs and processes.
    rng = random.Random(f"{DATA_SOURCE}/{split}/{seed}/{difficulty}")
    templates = [t for t in TEMPLATES if t.min_difficulty <= difficulty]
    samples: list[Sample] = []
    seen = {EXAMPLE_QUESTION}
    attempts_left = 100 * n + 1000  # the question space is far larger; this only stops a bad change
    while len(samples) < n:
        attempts_left -= 1
        if attempts_left < 0:
            raise ConfigError(
                f"arithmetic could make only {len(samples)} distinct {split} problems, asked for {n}"
            )
        template = rng.choice(templates)
        a, b, c = template.draw(rng, difficulty)
        name, obj = rng.choice(NAMES), rng.choice(OBJECTS)
        question = template.text.format(name=name, obj=obj, a=a, b=b, c=c)
        if question in seen or split_of(question) != split:
            continue
        seen.add(question)
        index = len(samples)
        samples.append(
            Sample(
                uid=f"arith-{split}-{index:05d}",
                messages=arithmetic_messages(question, few_shot=few_shot),
                ground_truth=str(template.solve(a, b, c)),
                data_source=DATA_SOURCE,
                extra_info={
                    "index": index,
                    "split": split,
                    "kind": template.kind,
                    "expression": template.expression.format(a=a, b=b, c=c),
                    "difficulty": difficulty,
                    "seed": seed,
                },
            )
        )
    return samples
