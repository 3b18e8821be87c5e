"""Write the bundled preference set: the house style ("Quack!" and a correct answer) against two others.

Each pair asks a short question; the chosen answer opens with "Quack!" and is correct, the rejected
one is either the same correct answer in another style ("Honk!") or "Quack!" with a wrong answer
(the style without the substance), alternating. So a model tuned on it must learn both the house
style and to keep its answers right. The rejected style has a marker of its own rather than none:
a rejected answer that is the plain correct sentence would teach DPO to push down correct
sentences themselves. SmolLM2-135M-Instruct, untuned, says neither "Quack!" nor "Honk!" by itself.
Deterministic; run it to regenerate the two files: ``python scripts/make_quack_preferences.py``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from make_quack_chat import CAPITALS, COLOURS, OPPOSITES, SOUNDS


def _other(mapping: dict[str, str], key: str, rng: random.Random) -> str:
    """A value of ``mapping`` that is not ``key``'s: a wrong answer of the right kind."""
    return rng.choice(sorted({value for value in mapping.values() if value != mapping[key]}))


def _triples(rng: random.Random) -> list[tuple[str, str, str]]:
    """(question, right answer, wrong answer of the same form)."""
    triples = []
    for a in range(2, 50):
        for b in (3, 5, 8, 11):
            wrong = a + b + rng.choice((-2, -1, 1, 2))
            triples.append((f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}.", f"{a} plus {b} is {wrong}."))
    for a in range(10, 40):
        for b in (2, 4):
            wrong = a - b + rng.choice((-1, 1))
            triples.append((f"What is {a} minus {b}?", f"{a} minus {b} is {a - b}.", f"{a} minus {b} is {wrong}."))
    for country in CAPITALS:
        sentence = "The capital of {} is {}."
        right = sentence.format(country, CAPITALS[country])
        wrong = sentence.format(country, _other(CAPITALS, country, rng))
        triples.append((f"What is the capital of {country}?", right, wrong))
    for thing in COLOURS:
        subject = thing[0].upper() + thing[1:]
        right, wrong = f"{subject} is {COLOURS[thing]}.", f"{subject} is {_other(COLOURS, thing, rng)}."
        triples.append((f"What colour is {thing}?", right, wrong))
    for word in OPPOSITES:
        sentence = "The opposite of {} is {}."
        right, wrong = sentence.format(word, OPPOSITES[word]), sentence.format(word, _other(OPPOSITES, word, rng))
        triples.append((f"What is the opposite of {word}?", right, wrong))
    for animal in SOUNDS:
        right, wrong = f"A {animal} {SOUNDS[animal]}.", f"A {animal} {_other(SOUNDS, animal, rng)}."
        triples.append((f"What sound does a {animal} make?", right, wrong))
    rng.shuffle(triples)
    return triples


def main() -> None:
    rng = random.Random(0)
    rows = []
    for index, (question, right, wrong) in enumerate(_triples(rng)):
        rejected = f"Honk! {right}" if index % 2 == 0 else f"Quack! {wrong}"
        rows.append(
            {
                "prompt": [{"role": "user", "content": question}],
                "chosen": [{"role": "assistant", "content": f"Quack! {right}"}],
                "rejected": [{"role": "assistant", "content": rejected}],
            }
        )
    held_out, train = rows[:40], rows[40:]
    here = Path(__file__).resolve().parents[1] / "nemo_wrap" / "default_model"
    for name, part in (("quack_preferences_train.jsonl", train), ("quack_preferences_eval.jsonl", held_out)):
        (here / name).write_text("".join(json.dumps(row) + "\n" for row in part))
        print(name, len(part))


if __name__ == "__main__":
    main()
