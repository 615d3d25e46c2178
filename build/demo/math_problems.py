"""Grade-school word problems with step-by-step worked solutions (the demo corpus's math
domain). Each template draws names, objects and integers from a seeded `random.Random`,
so a seed fixes the whole set; train and held-out use different seeds.

A document reads:
    Question: <problem>
    Answer: <one arithmetic step per line, each "... = value">
    #### <final integer>
"""

from __future__ import annotations

import random
from collections.abc import Callable

NAMES = ["Ava", "Ben", "Chloe", "Daniel", "Emma", "Farid", "Grace", "Hiro", "Isla", "Jamal", "Kira", "Liam",
         "Maya", "Noah", "Olivia", "Priya", "Quinn", "Rosa", "Sam", "Tariq", "Uma", "Victor", "Wen", "Yusuf",
         "Zoe"]
ITEMS = [("apple", "apples"), ("pencil", "pencils"), ("notebook", "notebooks"), ("cookie", "cookies"),
         ("marble", "marbles"), ("sticker", "stickers"), ("book", "books"), ("orange", "oranges"),
         ("cupcake", "cupcakes"), ("toy car", "toy cars"), ("shell", "shells"), ("card", "cards")]
PLACES = ["the market", "the bakery", "the school fair", "the bookstore", "the farm stand", "the toy shop"]
CONTAINERS = [("box", "boxes"), ("bag", "bags"), ("basket", "baskets"), ("crate", "crates"), ("jar", "jars")]
VEHICLES = [("car", "km"), ("train", "km"), ("bike", "km"), ("boat", "miles"), ("bus", "miles")]

Problem = tuple[str, list[str], int]


def _buy_and_change(r: random.Random) -> Problem:
    name, (item, items), place = r.choice(NAMES), r.choice(ITEMS), r.choice(PLACES)
    n, price = r.randint(2, 12), r.randint(2, 15)
    cost = n * price
    paid = r.choice([b for b in (20, 50, 100, 200) if b >= cost] or [cost + 10])
    q = (f"{name} buys {n} {items} at {place}. Each {item} costs ${price}. {name} pays with a ${paid} bill. "
         f"How much change does {name} get?")
    steps = [f"The {items} cost {n} * {price} = ${cost}.", f"The change is {paid} - {cost} = ${paid - cost}."]
    return q, steps, paid - cost


def _containers(r: random.Random) -> Problem:
    name, (_, items), (box, boxes) = r.choice(NAMES), r.choice(ITEMS), r.choice(CONTAINERS)
    n_box, per_box, extra = r.randint(3, 12), r.randint(4, 20), r.randint(1, 15)
    total = n_box * per_box + extra
    q = (f"{name} has {n_box} {boxes} of {items} with {per_box} {items} in each {box}, "
         f"and {extra} loose {items}. How many {items} does {name} have in total?")
    steps = [f"In the {boxes} there are {n_box} * {per_box} = {n_box * per_box} {items}.",
             f"Adding the loose ones gives {n_box * per_box} + {extra} = {total} {items}."]
    return q, steps, total


def _share_equally(r: random.Random) -> Problem:
    name, (_, items) = r.choice(NAMES), r.choice(ITEMS)
    friends, each = r.randint(2, 9), r.randint(3, 14)
    kept = r.randint(1, 10)
    total = friends * each + kept
    q = (f"{name} had {total} {items}. {name} kept {kept} and shared the rest equally among "
         f"{friends} friends. How many {items} did each friend get?")
    steps = [f"{name} shared {total} - {kept} = {total - kept} {items}.",
             f"Each friend got {total - kept} / {friends} = {each} {items}."]
    return q, steps, each


def _speed_distance(r: random.Random) -> Problem:
    name, (vehicle, unit) = r.choice(NAMES), r.choice(VEHICLES)
    speed, h1, h2 = r.randint(8, 90), r.randint(1, 6), r.randint(1, 5)
    q = (f"{name}'s {vehicle} travels at {speed} {unit} per hour. It travels for {h1} hours in the "
         f"morning and {h2} hours in the afternoon. How many {unit} does it travel in total?")
    steps = [f"The total time is {h1} + {h2} = {h1 + h2} hours.",
             f"The distance is {speed} * {h1 + h2} = {speed * (h1 + h2)} {unit}."]
    return q, steps, speed * (h1 + h2)


def _ages(r: random.Random) -> Problem:
    a, b = r.sample(NAMES, 2)
    age_a, diff, years = r.randint(5, 40), r.randint(2, 30), r.randint(2, 20)
    q = (f"{a} is {age_a} years old. {b} is {diff} years older than {a}. "
         f"How old will {b} be in {years} years?")
    steps = [f"{b} is now {age_a} + {diff} = {age_a + diff} years old.",
             f"In {years} years {b} will be {age_a + diff} + {years} = {age_a + diff + years} years old."]
    return q, steps, age_a + diff + years


def _rectangle(r: random.Random) -> Problem:
    name = r.choice(NAMES)
    w, h, price = r.randint(3, 30), r.randint(3, 30), r.randint(2, 12)
    area = w * h
    q = (f"{name} wants to cover a garden that is {w} meters long and {h} meters wide with grass. "
         f"Grass costs ${price} per square meter. How much will the grass cost?")
    steps = [f"The area is {w} * {h} = {area} square meters.",
             f"The cost is {area} * {price} = ${area * price}."]
    return q, steps, area * price


def _percent_discount(r: random.Random) -> Problem:
    name, (item, _) = r.choice(NAMES), r.choice(ITEMS)
    price = r.randint(2, 40) * 10
    pct = r.choice([10, 20, 25, 30, 40, 50])
    off = price * pct // 100
    q = (f"A {item} costs ${price}. It is on sale for {pct}% off. "
         f"How much does {name} pay for the {item} on sale?")
    steps = [f"The discount is {price} * {pct} / 100 = ${off}.",
             f"{name} pays {price} - {off} = ${price - off}."]
    return q, steps, price - off


def _weekly_savings(r: random.Random) -> Problem:
    name = r.choice(NAMES)
    per_week, weeks, spend = r.randint(3, 40), r.randint(3, 20), r.randint(5, 60)
    saved = per_week * weeks
    if spend > saved:
        spend = saved // 2
    q = (f"{name} saves ${per_week} every week for {weeks} weeks. Then {name} spends ${spend} on a present. "
         f"How much money does {name} have left?")
    steps = [f"{name} saves {per_week} * {weeks} = ${saved}.",
             f"After the present, {saved} - {spend} = ${saved - spend} is left."]
    return q, steps, saved - spend


def _three_people(r: random.Random) -> Problem:
    a, b, c = r.sample(NAMES, 3)
    _, items = r.choice(ITEMS)
    na, k, less = r.randint(3, 20), r.randint(2, 4), r.randint(1, 9)
    nb = k * na
    nc = nb - less
    q = (f"{a} has {na} {items}. {b} has {k} times as many {items} as {a}. "
         f"{c} has {less} fewer {items} than {b}. How many {items} do they have together?")
    steps = [f"{b} has {k} * {na} = {nb} {items}.", f"{c} has {nb} - {less} = {nc} {items}.",
             f"Together they have {na} + {nb} + {nc} = {na + nb + nc} {items}."]
    return q, steps, na + nb + nc


def _time_minutes(r: random.Random) -> Problem:
    name = r.choice(NAMES)
    tasks = r.randint(2, 4)
    mins = [r.randint(5, 45) for _ in range(tasks)]
    days = r.randint(2, 7)
    per_day = sum(mins)
    parts = ", ".join(f"{m} minutes" for m in mins[:-1]) + f" and {mins[-1]} minutes"
    q = (f"Every day {name} spends {parts} on {tasks} different chores. "
         f"How many minutes does {name} spend on chores in {days} days?")
    steps = [f"Each day takes {' + '.join(map(str, mins))} = {per_day} minutes.",
             f"In {days} days that is {per_day} * {days} = {per_day * days} minutes."]
    return q, steps, per_day * days


def _rows_of_seats(r: random.Random) -> Problem:
    rows, seats, taken = r.randint(4, 25), r.randint(6, 20), r.randint(1, 50)
    total = rows * seats
    taken = min(taken, total - 1)
    q = (f"A hall has {rows} rows with {seats} seats in each row. {taken} seats are already taken. "
         f"How many seats are still free?")
    steps = [f"The hall has {rows} * {seats} = {total} seats.",
             f"Free seats: {total} - {taken} = {total - taken}."]
    return q, steps, total - taken


def _recipe_scale(r: random.Random) -> Problem:
    name = r.choice(NAMES)
    base, grams, target = r.randint(2, 6), r.randint(2, 12) * 25, r.randint(2, 5)
    servings = base * target
    q = (f"A recipe for {base} people needs {grams} grams of flour. {name} is cooking for {servings} people. "
         f"How many grams of flour does {name} need?")
    steps = [f"{servings} people is {servings} / {base} = {target} times the recipe.",
             f"The flour needed is {grams} * {target} = {grams * target} grams."]
    return q, steps, grams * target


def _fruit_stand(r: random.Random) -> Problem:
    name = r.choice(NAMES)
    (i1, p1), (i2, p2) = r.sample([("apple", "apples"), ("orange", "oranges"), ("pear", "pears"),
                                   ("banana", "bananas"), ("lemon", "lemons")], 2)
    n1, c1, n2, c2 = r.randint(2, 15), r.randint(1, 5), r.randint(2, 15), r.randint(1, 5)
    q = (f"At {r.choice(PLACES)}, {p1} cost ${c1} each and {p2} cost ${c2} each. {name} buys {n1} {p1} and "
         f"{n2} {p2}. How much does {name} spend?")
    steps = [f"The {p1} cost {n1} * {c1} = ${n1 * c1}.", f"The {p2} cost {n2} * {c2} = ${n2 * c2}.",
             f"In total {name} spends {n1 * c1} + {n2 * c2} = ${n1 * c1 + n2 * c2}."]
    return q, steps, n1 * c1 + n2 * c2


def _pages_per_day(r: random.Random) -> Problem:
    name = r.choice(NAMES)
    per_day, days, left = r.randint(5, 40), r.randint(2, 14), r.randint(10, 200)
    read = per_day * days
    total = read + left
    q = (f"{name}'s book has {total} pages. {name} reads {per_day} pages a day for {days} days. "
         f"How many pages are left to read?")
    steps = [f"{name} has read {per_day} * {days} = {read} pages.", f"Pages left: {total} - {read} = {left}."]
    return q, steps, left


TEMPLATES: list[Callable[[random.Random], Problem]] = [
    _buy_and_change, _containers, _share_equally, _speed_distance, _ages, _rectangle, _percent_discount,
    _weekly_savings, _three_people, _time_minutes, _rows_of_seats, _recipe_scale, _fruit_stand,
    _pages_per_day,
]


def format_problem(question: str, steps: list[str], answer: int) -> str:
    return f"Question: {question}\nAnswer: " + "\n".join(steps) + f"\n#### {answer}"


def generate_problems(n: int, seed: int) -> list[str]:
    """n formatted problems; the same (n, seed) always gives the same list."""
    r = random.Random(seed)
    return [format_problem(*r.choice(TEMPLATES)(r)) for _ in range(n)]


if __name__ == "__main__":
    for p in generate_problems(3, 0):
        print(p, end="\n\n")
