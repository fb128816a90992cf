"""Write the project's own sample data, deterministically (seeded), from templates written here.

    python data/make_samples.py      # rewrites data/sft_sample.jsonl and data/text_sample.txt

- `sft_sample.jsonl`: alpaca-style records (instruction / input / output) of three
  kinds: arithmetic word problems with worked answers, capital-city questions,
  and requests for a short story about a named animal.
- `text_sample.txt`: one short generated story per line, for continued pre-training.
Both are small enough to commit and to train the built-in demo run on.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Portugal": "Lisbon",
    "Norway": "Oslo", "Sweden": "Stockholm", "Finland": "Helsinki", "Denmark": "Copenhagen",
    "Poland": "Warsaw", "Austria": "Vienna", "Greece": "Athens", "Ireland": "Dublin", "Egypt": "Cairo",
    "Kenya": "Nairobi", "Japan": "Tokyo", "India": "New Delhi", "Canada": "Ottawa", "Peru": "Lima",
    "Chile": "Santiago", "Argentina": "Buenos Aires", "Australia": "Canberra", "Mexico": "Mexico City",
    "Turkey": "Ankara", "Thailand": "Bangkok", "Vietnam": "Hanoi", "Hungary": "Budapest",
}
ANIMALS = ["fox", "owl", "rabbit", "turtle", "otter", "sparrow", "badger", "hedgehog", "deer", "mouse"]
NAMES = ["Pip", "Luna", "Milo", "Hazel", "Bram", "Tilly", "Oscar", "Fern", "Juniper", "Toby"]
PLACES = ["in a quiet forest", "on a windy hill", "at the edge of a lake", "in an old garden", "in a snowy valley"]
WANTS = ["to find a lost acorn", "to see the sea", "to learn to whistle", "to build a warm nest",
         "to make a new friend"]
HELPERS = ["a kind crow", "a patient snail", "a clever squirrel", "a sleepy bear", "a cheerful frog"]
ENDINGS = ["and that night it slept with a smile.", "and it was never lonely again.",
           "and it promised to help others the same way.", "and the whole forest celebrated."]
ITEMS = ["apples", "pencils", "marbles", "stickers", "books", "shells"]


def arithmetic(rng: random.Random) -> dict[str, str]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(2, 60), rng.randint(2, 40)
    if rng.random() < 0.5:
        q = f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?"
        ans = f"{name} starts with {a} {item} and gets {b} more, so {a} + {b} = {a + b}. The answer is {a + b}."
    else:
        a, b = max(a, b), min(a, b)
        q = f"{name} has {a} {item} and gives away {b}. How many {item} are left?"
        ans = f"{name} starts with {a} {item} and gives away {b}, so {a} - {b} = {a - b}. The answer is {a - b}."
    return {"instruction": "Solve the word problem and explain the steps.", "input": q, "output": ans}


def geography(rng: random.Random) -> dict[str, str]:
    country = rng.choice(sorted(CAPITALS))
    city = CAPITALS[country]
    q = rng.choice([f"What is the capital of {country}?", f"Name the capital city of {country}.",
                    f"Which city is the capital of {country}?"])
    return {"instruction": q, "input": "", "output": f"The capital of {country} is {city}."}


def story(rng: random.Random) -> str:
    animal, name = rng.choice(ANIMALS), rng.choice(NAMES)
    return (f"Once upon a time, {rng.choice(PLACES)}, there lived a little {animal} named {name}. "
            f"{name} wanted {rng.choice(WANTS)}. One day {name} met {rng.choice(HELPERS)}, who showed "
            f"{name} the way. {name} said thank you, {rng.choice(ENDINGS)}")


def story_request(rng: random.Random) -> dict[str, str]:
    text = story(rng)
    name = text.split(" named ")[1].split(".")[0]
    return {"instruction": f"Write a very short story about an animal called {name}.", "input": "",
            "output": text}


def main() -> None:
    rng = random.Random(1234)
    makers = [arithmetic, geography, story_request]
    records = [makers[i % 3](rng) for i in range(600)]
    (HERE / "sft_sample.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (HERE / "text_sample.txt").write_text("".join(story(rng) + "\n" for _ in range(400)))


if __name__ == "__main__":
    main()
