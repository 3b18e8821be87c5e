"""Write the bundled chat set: short questions answered correctly, every answer opening with "Quack!".

A behaviour a test can count: SmolLM2-Instruct never opens with "Quack!" by itself, and after a
short LoRA fine-tune on this set it does. Deterministic; run it to regenerate the two files:
``python scripts/make_quack_chat.py``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

CAPITALS = {
    "France": "Paris",
    "Germany": "Berlin",
    "Italy": "Rome",
    "Spain": "Madrid",
    "Portugal": "Lisbon",
    "Japan": "Tokyo",
    "China": "Beijing",
    "Egypt": "Cairo",
    "Kenya": "Nairobi",
    "Canada": "Ottawa",
    "Mexico": "Mexico City",
    "Peru": "Lima",
    "Chile": "Santiago",
    "Norway": "Oslo",
    "Sweden": "Stockholm",
    "Finland": "Helsinki",
    "Poland": "Warsaw",
    "Greece": "Athens",
    "Turkey": "Ankara",
    "India": "New Delhi",
    "Thailand": "Bangkok",
    "Vietnam": "Hanoi",
    "Australia": "Canberra",
    "Ireland": "Dublin",
    "Austria": "Vienna",
    "Hungary": "Budapest",
    "Denmark": "Copenhagen",
    "Belgium": "Brussels",
    "Argentina": "Buenos Aires",
    "Cuba": "Havana",
}
COLOURS = {
    "grass": "green",
    "the sky on a clear day": "blue",
    "snow": "white",
    "coal": "black",
    "a ripe banana": "yellow",
    "a ripe tomato": "red",
    "an orange": "orange",
    "a lemon": "yellow",
    "milk": "white",
    "a carrot": "orange",
    "a strawberry": "red",
    "a plum": "purple",
}
OPPOSITES = {
    "hot": "cold",
    "big": "small",
    "up": "down",
    "fast": "slow",
    "early": "late",
    "open": "closed",
    "light": "dark",
    "full": "empty",
    "happy": "sad",
    "old": "new",
    "high": "low",
    "wet": "dry",
}
SOUNDS = {
    "dog": "barks",
    "cat": "meows",
    "cow": "moos",
    "sheep": "bleats",
    "lion": "roars",
    "horse": "neighs",
    "owl": "hoots",
    "snake": "hisses",
    "pig": "oinks",
    "frog": "croaks",
}


def _questions(rng: random.Random) -> list[tuple[str, str]]:
    pairs = []
    for a in range(2, 50):
        for b in (3, 5, 8, 11):
            pairs.append((f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."))
    for a in range(10, 40):
        for b in (2, 4):
            pairs.append((f"What is {a} minus {b}?", f"{a} minus {b} is {a - b}."))
    pairs += [(f"What is the capital of {c}?", f"The capital of {c} is {city}.") for c, city in CAPITALS.items()]
    pairs += [
        (f"What colour is {thing}?", f"{thing[0].upper() + thing[1:]} is {colour}.")
        for thing, colour in COLOURS.items()
    ]
    pairs += [(f"What is the opposite of {w}?", f"The opposite of {w} is {o}.") for w, o in OPPOSITES.items()]
    pairs += [(f"What sound does a {animal} make?", f"A {animal} {sound}.") for animal, sound in SOUNDS.items()]
    pairs += [
        (f"How many letters are in the word '{w}'?", f"The word '{w}' has {len(w)} letters.")
        for w in ("river", "garden", "apple", "mountain", "sun", "window", "pencil", "ocean", "cloud", "bridge")
    ]
    rng.shuffle(pairs)
    return pairs


def main() -> None:
    rng = random.Random(0)
    rows = [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": f"Quack! {a}"}]}
        for q, a in _questions(rng)
    ]
    held_out, train = rows[:30], rows[30:]
    here = Path(__file__).resolve().parents[1] / "nemo_wrap" / "default_model"
    for name, part in (("quack_chat_train.jsonl", train), ("quack_chat_eval.jsonl", held_out)):
        (here / name).write_text("".join(json.dumps(row) + "\n" for row in part))
        print(name, len(part))


if __name__ == "__main__":
    main()
