#!/usr/bin/env python3
"""Writes demo/train.jsonl and demo/valid.jsonl: a small, deterministic
preference dataset in TRL's conversational form for the lorafit ORPO demo.

Every row is {"prompt": [{"role": "user", ...}], "chosen": [{"role":
"assistant", ...}], "rejected": [{"role": "assistant", ...}]} built from
templated facts (arithmetic, capitals, opposites, unit conversions, plurals,
animal sounds, days and months). The preference signal is deliberately
consistent so that a 135M model learns it in a few CPU minutes, and one the
base model does not already have, so held-out accuracy starts near zero:

* chosen: the correct fact as one short sentence IN CAPITAL LETTERS
  ("SURE! 6 LITERS IS 6000 MILLILITERS.");
* rejected: the same correct sentence in ordinary case
  ("Sure! 6 liters is 6000 milliliters.").

The pairs differ only in style, a positive control for preference training:
after ORPO the adapter should prefer (and generate) capitalised answers. The
wrong answers and hedging phrasings the generator also builds are kept in
`wrong` for other experiments but do not enter the files.

Prompts in valid.jsonl never occur in train.jsonl. Standard library only;
the output is identical for a given --seed.

    python3 scripts/make_demo_data.py [--out demo] [--seed 1234]
"""

import argparse
import json
import os
import random

CAPITALS = [
    ("France", "Paris", "Lyon"), ("Germany", "Berlin", "Munich"),
    ("Italy", "Rome", "Milan"), ("Spain", "Madrid", "Barcelona"),
    ("Japan", "Tokyo", "Osaka"), ("Australia", "Canberra", "Sydney"),
    ("Canada", "Ottawa", "Toronto"), ("Brazil", "Brasilia", "Rio de Janeiro"),
    ("Turkey", "Ankara", "Istanbul"), ("India", "New Delhi", "Mumbai"),
    ("China", "Beijing", "Shanghai"), ("Russia", "Moscow", "Saint Petersburg"),
    ("Egypt", "Cairo", "Alexandria"), ("Kenya", "Nairobi", "Mombasa"),
    ("Nigeria", "Abuja", "Lagos"), ("Morocco", "Rabat", "Casablanca"),
    ("Switzerland", "Bern", "Zurich"), ("Netherlands", "Amsterdam", "Rotterdam"),
    ("Belgium", "Brussels", "Antwerp"), ("Portugal", "Lisbon", "Porto"),
    ("Greece", "Athens", "Thessaloniki"), ("Poland", "Warsaw", "Krakow"),
    ("Sweden", "Stockholm", "Gothenburg"), ("Norway", "Oslo", "Bergen"),
    ("Finland", "Helsinki", "Tampere"), ("Denmark", "Copenhagen", "Aarhus"),
    ("Austria", "Vienna", "Salzburg"), ("Ireland", "Dublin", "Cork"),
    ("Mexico", "Mexico City", "Guadalajara"), ("Argentina", "Buenos Aires", "Cordoba"),
    ("Chile", "Santiago", "Valparaiso"), ("Peru", "Lima", "Cusco"),
    ("Colombia", "Bogota", "Medellin"), ("Vietnam", "Hanoi", "Ho Chi Minh City"),
    ("Thailand", "Bangkok", "Chiang Mai"), ("South Korea", "Seoul", "Busan"),
    ("Pakistan", "Islamabad", "Karachi"), ("New Zealand", "Wellington", "Auckland"),
    ("Scotland", "Edinburgh", "Glasgow"), ("Hungary", "Budapest", "Debrecen"),
]

OPPOSITES = [
    ("hot", "cold"), ("big", "small"), ("fast", "slow"), ("happy", "sad"),
    ("up", "down"), ("light", "dark"), ("old", "young"), ("open", "closed"),
    ("full", "empty"), ("early", "late"), ("hard", "soft"), ("high", "low"),
    ("long", "short"), ("near", "far"), ("rich", "poor"), ("strong", "weak"),
    ("wet", "dry"), ("thick", "thin"), ("loud", "quiet"), ("clean", "dirty"),
    ("heavy", "light"), ("wide", "narrow"), ("true", "false"), ("day", "night"),
    ("inside", "outside"), ("win", "lose"), ("buy", "sell"), ("push", "pull"),
    ("begin", "end"), ("friend", "enemy"), ("north", "south"), ("east", "west"),
    ("left", "right"), ("question", "answer"), ("arrive", "leave"),
    ("remember", "forget"), ("summer", "winter"), ("sweet", "sour"),
    ("safe", "dangerous"), ("cheap", "expensive"),
]

PLURALS = [
    ("mouse", "mice"), ("child", "children"), ("foot", "feet"), ("tooth", "teeth"),
    ("goose", "geese"), ("man", "men"), ("woman", "women"), ("person", "people"),
    ("ox", "oxen"), ("cactus", "cacti"), ("leaf", "leaves"), ("knife", "knives"),
    ("wolf", "wolves"), ("half", "halves"), ("city", "cities"), ("baby", "babies"),
    ("box", "boxes"), ("bus", "buses"), ("potato", "potatoes"), ("sheep", "sheep"),
]

ANIMALS = [
    ("cow", "moo"), ("dog", "woof"), ("cat", "meow"), ("duck", "quack"),
    ("sheep", "baa"), ("pig", "oink"), ("lion", "roar"), ("snake", "hiss"),
    ("owl", "hoot"), ("horse", "neigh"), ("frog", "croak"), ("bee", "buzz"),
]

DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July",
          "August", "September", "October", "November", "December"]

# (from unit plural, to unit plural, factor, wrong factor)
CONVERSIONS = [
    ("kilometers", "meters", 1000, 100),
    ("meters", "centimeters", 100, 10),
    ("hours", "minutes", 60, 100),
    ("minutes", "seconds", 60, 100),
    ("kilograms", "grams", 1000, 100),
    ("weeks", "days", 7, 5),
    ("days", "hours", 24, 12),
    ("years", "months", 12, 10),
    ("liters", "milliliters", 1000, 100),
]

HEDGES = [
    "Hmm, I think {x}, but I'm not really sure.",
    "Well, maybe {x}? I could be wrong about that though.",
    "I guess {x}, but honestly I don't remember very well.",
]


def fact(prompt, right, wrong):
    """A (prompt, correct statement, wrong statement) triple."""
    return prompt, right, wrong


def arithmetic(rng):
    out = []
    for a in range(2, 21):
        for b in range(2, 21):
            out.append(("add", fact(f"What is {a} plus {b}?",
                                    f"{a} plus {b} is {a + b}",
                                    f"{a} plus {b} is {a + b + rng.choice([-3, -2, -1, 1, 2, 3])}")))
            if a > b:
                out.append(("sub", fact(f"What is {a} minus {b}?",
                                        f"{a} minus {b} is {a - b}",
                                        f"{a} minus {b} is {a - b + rng.choice([1, 2, 3])}")))
            if a <= 12 and b <= 12:
                out.append(("mul", fact(f"What is {a} times {b}?",
                                        f"{a} times {b} is {a * b}",
                                        f"{a} times {b} is {a * b + rng.choice([-2, -1, 1, 2, a, b])}")))
    return out


def capitals(rng):
    return [("capital", fact(f"What is the capital of {c}?",
                             f"The capital of {c} is {cap}",
                             f"the capital of {c} is {decoy}"))
            for c, cap, decoy in CAPITALS]


def opposites(rng):
    words = [w for pair in OPPOSITES for w in pair]
    out = []
    for w, o in OPPOSITES:
        # Exclude every word paired with w anywhere ("light": dark and heavy).
        ok = {a for pair in OPPOSITES if w in pair for a in pair}
        wrong = rng.choice([x for x in words if x not in ok])
        out.append(("opposite", fact(f"What is the opposite of \"{w}\"?",
                                     f"The opposite of \"{w}\" is \"{o}\"",
                                     f"the opposite of \"{w}\" is \"{wrong}\"")))
    return out


def conversions(rng):
    out = []
    for src, dst, k, bad in CONVERSIONS:
        for n in range(2, 10):
            out.append(("convert", fact(f"How many {dst} are in {n} {src}?",
                                        f"{n} {src} is {n * k} {dst}",
                                        f"{n} {src} is {n * bad} {dst}")))
    return out


def words(rng):
    out = []
    for s, p in PLURALS:
        wrong = s + "s" if p != s + "s" else s + "es"
        out.append(("plural", fact(f"What is the plural of \"{s}\"?",
                                   f"The plural of \"{s}\" is \"{p}\"",
                                   f"the plural of \"{s}\" is \"{wrong}\"")))
    sounds = [snd for _, snd in ANIMALS]
    for a, snd in ANIMALS:
        wrong = rng.choice([x for x in sounds if x != snd])
        out.append(("animal", fact(f"What sound does a {a} make?",
                                   f"A {a} says \"{snd}\"",
                                   f"a {a} says \"{wrong}\"")))
    for seq, what in ((DAYS, "day"), (MONTHS, "month")):
        for i, d in enumerate(seq):
            nxt = seq[(i + 1) % len(seq)]
            wrong = seq[(i + rng.choice([2, 3, len(seq) - 1])) % len(seq)]
            out.append(("next", fact(f"Which {what} comes after {d}?",
                                     f"The {what} after {d} is {nxt}",
                                     f"the {what} after {d} is {wrong}")))
    return out


# How many prompts of each category to use (train + valid).
QUOTA = {"add": 46, "sub": 30, "mul": 36, "capital": 40, "opposite": 40,
         "convert": 45, "plural": 20, "animal": 12, "next": 19}


def row(prompt, right, wrong, rng):
    rng.choice(HEDGES)  # keeps the generator's random stream as before
    chosen = f"Sure! {right}.".upper()
    rejected = f"Sure! {right}."
    return {
        "prompt": [{"role": "user", "content": prompt}],
        "chosen": [{"role": "assistant", "content": chosen}],
        "rejected": [{"role": "assistant", "content": rejected}],
    }


def stratified_split(rows, quota, n_valid):
    """(train, valid) from `(category, fact)` rows in their order: about the same share of
    every category in valid (largest remainders first)."""
    total = len(rows)
    share = {cat: quota[cat] * n_valid // total for cat in quota}
    by_remainder = sorted(quota, key=lambda c: (-(quota[c] * n_valid % total), c))
    for cat in by_remainder[: n_valid - sum(share.values())]:
        share[cat] += 1
    valid, train = [], []
    taken = {}
    for cat, f in rows:
        if taken.get(cat, 0) < share[cat]:
            taken[cat] = taken.get(cat, 0) + 1
            valid.append(f)
        else:
            train.append(f)
    return train, valid


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.normpath(
        os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "demo")))
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--valid", type=int, default=48)
    args = ap.parse_args()
    rng = random.Random(args.seed)

    pool = arithmetic(rng) + capitals(rng) + opposites(rng) + conversions(rng) + words(rng)
    by_cat = {}
    for cat, f in pool:
        by_cat.setdefault(cat, []).append(f)
    chosen_facts = []
    for cat in sorted(QUOTA):
        facts = by_cat[cat]
        rng.shuffle(facts)
        chosen_facts += [(cat, f) for f in facts[:QUOTA[cat]]]
    prompts = [f[0] for _, f in chosen_facts]
    assert len(set(prompts)) == len(prompts), "duplicate prompts"
    rng.shuffle(chosen_facts)

    train, valid = stratified_split(chosen_facts, QUOTA, args.valid)

    os.makedirs(args.out, exist_ok=True)
    for name, facts in (("train.jsonl", train), ("valid.jsonl", valid)):
        with open(os.path.join(args.out, name), "w", encoding="utf-8") as fh:
            for prompt, right, wrong in facts:
                fh.write(json.dumps(row(prompt, right, wrong, rng), ensure_ascii=False) + "\n")
        print(f"wrote {len(facts)} rows to {os.path.join(args.out, name)}")
    assert not {f[0] for f in train} & {f[0] for f in valid}


if __name__ == "__main__":
    main()
