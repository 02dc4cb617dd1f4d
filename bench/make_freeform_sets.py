"""Write the free-form capability sets, ``trainer/rails/freeform_gate.jsonl`` and ``freeform_bench.jsonl``.

Deterministic: the tables and templates below (answers known), split so that no fact, operand pair, instruction
topic or passage filling is in both sets; a prompt the project trains or demonstrates on (the probes, the live
loop's prompts, the README's and docs' quoted questions) is left out. ``--calibrate`` generates the base model's
greedy replies (cached in ``bench/out/``), sets each item's ``max_tokens`` to what its right reply needs and prints
the base model's accuracy per category; otherwise an unchanged item keeps the shipped ``max_tokens``.

    python bench/make_freeform_sets.py [--calibrate]
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import re
from pathlib import Path

from livelora.trainer.capability import CATEGORIES, CapabilityItem, stratified

REPO = Path(__file__).resolve().parent.parent
RAILS = REPO / "trainer" / "rails"
GATE_SHARE = 0.62  # of each table's rows; the rest go to the bench's set
SIZES = {
    "gate": {"arithmetic": 84, "instruction": 68, "reading": 50},
    "bench": {"arithmetic": 52, "instruction": 44, "reading": 32},
}
MAX_TOKENS = {"fact": 32, "arithmetic": 48, "reading": 32, "instruction": 48}  # before a calibration
GEN_TOKENS = {"fact": 40, "arithmetic": 48, "reading": 40, "instruction": 80}  # the calibration's replies
FLOOR = {"fact": 24, "arithmetic": 24, "reading": 24, "instruction": 32}  # least max_tokens after it

# fact tables: (domain, prompt, answer) -- answer: "a|b" accepted alternatives, or an int (a number check)
FACTS: list[tuple[str, str, str | int]] = []
for country, city in [
    ("Canada", "Ottawa"), ("Australia", "Canberra"), ("Egypt", "Cairo"), ("Russia", "Moscow"), ("China", "Beijing"),
    ("Argentina", "Buenos Aires"), ("Portugal", "Lisbon"), ("Greece", "Athens"), ("Ireland", "Dublin"),
    ("Norway", "Oslo"), ("Sweden", "Stockholm"), ("Finland", "Helsinki"), ("Denmark", "Copenhagen"),
    ("Poland", "Warsaw"), ("Austria", "Vienna"), ("Hungary", "Budapest"), ("the Czech Republic", "Prague"),
    ("Belgium", "Brussels"), ("Turkey", "Ankara"), ("Kenya", "Nairobi"), ("South Korea", "Seoul"),
    ("Thailand", "Bangkok"), ("Vietnam", "Hanoi"), ("Indonesia", "Jakarta"), ("Peru", "Lima"), ("Cuba", "Havana"),
    ("New Zealand", "Wellington"), ("Iceland", "Reykjavik"), ("Mexico", "Mexico City"), ("India", "New Delhi|Delhi"),
]:  # fmt: skip
    FACTS.append(("capitals", f"What is the capital of {country}?", city))
FACTS += [
    ("geography", "On which continent is Kenya?", "Africa"),
    ("geography", "On which continent is Brazil?", "South America"),
    ("geography", "On which continent is Norway?", "Europe"),
    ("geography", "On which continent is Vietnam?", "Asia"),
    ("geography", "On which continent is Canada?", "North America"),
    ("geography", "Which river flows through Cairo?", "Nile"),
    ("geography", "Which river flows through London?", "Thames"),
    ("geography", "What is the largest desert in Africa?", "Sahara"),
    ("geography", "In which country is the Eiffel Tower?", "France"),
    ("geography", "In which country is the Taj Mahal?", "India"),
    ("geography", "In which city is the Colosseum?", "Rome"),
    ("geography", "What is the largest country in the world by area?", "Russia"),
    ("geography", "Which ocean lies between Europe and North America?", "Atlantic"),
    ("geography", "What is the highest mountain in Africa?", "Kilimanjaro"),
    ("geography", "Which European country is shaped like a boot?", "Italy"),
    ("geography", "In which country is the city of Toronto?", "Canada"),
    ("geography", "Which sea lies between Europe and Africa?", "Mediterranean"),
    ("geography", "Which US state is made up of islands in the Pacific Ocean?", "Hawaii"),
    ("geography", "What is the largest island in the world?", "Greenland"),
    ("geography", "What is the imaginary line around the middle of the Earth called?", "equator"),
    ("geography", "In which country is the city of Sydney?", "Australia"),
    ("geography", "What is the largest city in the United States?", "New York"),
    ("science", "What is the chemical symbol for gold?", "Au"),
    ("science", "What is the chemical symbol for silver?", "Ag"),
    ("science", "What is the chemical symbol for iron?", "Fe"),
    ("science", "What is the chemical symbol for sodium?", "Na"),
    ("science", "What is the chemical symbol for copper?", "Cu"),
    ("science", "What gas do plants take in from the air to make food?", "carbon dioxide|CO2"),
    ("science", "What gas do humans need to breathe in to live?", "oxygen"),
    ("science", "What is the centre of an atom called?", "nucleus"),
    ("science", "Which planet is known as the Red Planet?", "Mars"),
    ("science", "What is the largest organ of the human body?", "skin"),
    ("science", "Which organ pumps blood around the body?", "heart"),
    ("science", "How many bones are in the adult human body?", 206),
    ("science", "What is the hardest natural substance?", "diamond|diamonds"),
    ("science", "What do we call animals that eat only plants?", "herbivore|herbivores|herbivorous"),
    ("science", "Which planet is famous for its large rings?", "Saturn"),
    ("science", "What is the name of the galaxy we live in?", "Milky Way"),
    ("science", "What is the process of liquid water turning into vapour called?", "evaporation"),
    ("science", "How many planets are in our solar system?", 8),
    ("science", "Who developed the theory of relativity?", "Einstein"),
    ("science", "Who discovered penicillin?", "Fleming"),
    ("science", "Who proposed the theory of evolution by natural selection?", "Darwin"),
    ("science", "What does a thermometer measure?", "temperature"),
    ("science", "Which part of the eye gives it its colour?", "iris"),
    ("science", "What is the closest star to the Earth?", "Sun"),
    ("science", "What kind of energy do solar panels collect?", "solar|sunlight|light"),
    ("science", "What is the unit of electrical resistance?", "ohm|ohms"),
    ("history", "Who was the first president of the United States?", "Washington"),
    ("history", "In which year did World War II end?", 1945),
    ("history", "In which year did Christopher Columbus first reach the Americas?", 1492),
    ("history", "Who was the first person to walk on the Moon?", "Armstrong"),
    ("history", "In which year did the Titanic sink?", 1912),
    ("history", "Who was the first emperor of Rome?", "Augustus"),
    ("history", "Who was the British prime minister for most of World War II?", "Churchill"),
    ("history", "Which city's wall fell in 1989?", "Berlin"),
    ("history", "Who was the main author of the Declaration of Independence?", "Jefferson"),
    ("history", "Which ship carried the Pilgrims to America in 1620?", "Mayflower"),
    ("history", "Which French emperor was defeated at Waterloo?", "Napoleon"),
    ("history", "Who was the first woman to win a Nobel Prize?", "Curie"),
    ("history", "Which South American people built Machu Picchu?", "Inca|Incas"),
    ("history", "In which year did the First World War begin?", 1914),
    ("history", "Who was the first human to travel into space?", "Gagarin"),
    ("history", "Who invented the light bulb?", "Edison"),
    ("history", "Who invented the printing press in Europe?", "Gutenberg"),
    ("history", "Which Roman city was buried by the eruption of Vesuvius?", "Pompeii"),
    ("history", "Which ancient wonder was a lighthouse in Alexandria?", "Pharos|lighthouse of alexandria"),
    ("history", "Which country did the Aztec empire rule?", "Mexico"),
    ("literature", "Who wrote Hamlet?", "Shakespeare"),
    ("literature", "Who wrote Pride and Prejudice?", "Austen"),
    ("literature", "Who wrote the novel 1984?", "Orwell"),
    ("literature", "Who wrote the Harry Potter books?", "Rowling"),
    ("literature", "Who wrote The Adventures of Tom Sawyer?", "Twain"),
    ("literature", "Who wrote Oliver Twist?", "Dickens"),
    ("literature", "Who wrote War and Peace?", "Tolstoy"),
    ("literature", "Who wrote Don Quixote?", "Cervantes"),
    ("literature", "Who wrote The Odyssey?", "Homer"),
    ("literature", "Who wrote Alice's Adventures in Wonderland?", "Carroll"),
    ("literature", "Who wrote The Hobbit?", "Tolkien"),
    ("literature", "Who wrote Frankenstein?", "Shelley"),
    ("literature", "Who wrote the Sherlock Holmes stories?", "Doyle"),
    ("literature", "Who wrote The Old Man and the Sea?", "Hemingway"),
    ("literature", "Who wrote Moby-Dick?", "Melville"),
    ("literature", "What is the name of the wizarding school in Harry Potter?", "Hogwarts"),
    ("arts", "Who painted The Starry Night?", "Gogh"),
    ("arts", "Who painted the ceiling of the Sistine Chapel?", "Michelangelo"),
    ("arts", "Who painted Guernica?", "Picasso"),
    ("arts", "Who painted The Scream?", "Munch"),
    ("arts", "Who painted the Water Lilies series?", "Monet"),
    ("arts", "Who composed The Magic Flute?", "Mozart"),
    ("arts", "Which composer wrote the Moonlight Sonata?", "Beethoven"),
    ("arts", "Which instrument has 88 keys?", "piano"),
    ("arts", "How many strings does a standard guitar have?", 6),
    ("arts", "Who sculpted The Thinker?", "Rodin"),
    ("arts", "In which city is the Louvre museum?", "Paris"),
    ("arts", "Which ballet by Tchaikovsky features a prince and swans?", "Swan Lake"),
    ("animals", "What is a baby dog called?", "puppy|pup"),
    ("animals", "What is a baby cat called?", "kitten"),
    ("animals", "What is a baby cow called?", "calf"),
    ("animals", "What is a baby horse called?", "foal|colt|filly"),
    ("animals", "What is a baby sheep called?", "lamb"),
    ("animals", "What is a baby frog called?", "tadpole"),
    ("animals", "What is a baby kangaroo called?", "joey"),
    ("animals", "What is a baby bear called?", "cub"),
    ("animals", "What sound does a cow make?", "moo"),
    ("animals", "What sound does a duck make?", "quack"),
    ("animals", "What is the largest animal on Earth?", "blue whale"),
    ("animals", "What is the fastest land animal?", "cheetah"),
    ("animals", "How many arms does an octopus have?", 8),
    ("animals", "Which bird is a symbol of peace?", "dove"),
    ("animals", "What does a caterpillar turn into?", "butterfly|moth"),
    ("animals", "Which animal is called the king of the jungle?", "lion"),
    ("animals", "Which animal has a very long neck and eats leaves from tall trees?", "giraffe"),
    ("animals", "Which African animal looks like a horse with black and white stripes?", "zebra"),
    ("animals", "What do giant pandas mainly eat?", "bamboo"),
    ("animals", "Which mammal can truly fly?", "bat|bats"),
    ("animals", "What is a group of wolves called?", "pack"),
    ("animals", "Which animal gives us wool?", "sheep"),
    ("animals", "What is the largest land animal?", "elephant"),
    ("animals", "What do we call an animal that eats only meat?", "carnivore|carnivores|carnivorous"),
    ("animals", "What is the home of bees called?", "hive|beehive"),
    ("animals", "How many legs does an insect have?", 6),
    ("animals", "What kind of animal is a whale: a fish or a mammal?", "mammal"),
    ("animals", "Which bird cannot fly and lives in Antarctica?", "penguin|penguins"),
    ("units", "How many centimetres are in a metre?", 100),
    ("units", "How many minutes are in an hour?", 60),
    ("units", "How many hours are in a day?", 24),
    ("units", "How many months are in a year?", 12),
    ("units", "How many grams are in a kilogram?", 1000),
    ("units", "How many millilitres are in a litre?", 1000),
    ("units", "How many weeks are in a year?", 52),
    ("units", "How many sides does a hexagon have?", 6),
    ("units", "How many sides does a triangle have?", 3),
    ("units", "How many sides does a pentagon have?", 5),
    ("units", "How many sides does an octagon have?", 8),
    ("units", "How many degrees are in a right angle?", 90),
    ("units", "How many degrees are in a full circle?", 360),
    ("units", "How many inches are in a foot?", 12),
    ("units", "How many years are in a century?", 100),
    ("units", "How many years are in a decade?", 10),
    ("units", "How many eggs are in a dozen?", 12),
    ("units", "How many cents are in a dollar?", 100),
    ("units", "How many seconds are in a minute?", 60),
    ("units", "What unit is electric current measured in?", "ampere|amperes|amp|amps"),
    ("words", "What is the opposite of big?", "small|little|tiny"),
    ("words", "What is the opposite of fast?", "slow"),
    ("words", "What is the opposite of happy?", "sad|unhappy"),
    ("words", "What is the opposite of wet?", "dry"),
    ("words", "What is the opposite of full?", "empty"),
    ("words", "What is the opposite of early?", "late"),
    ("words", "What is the opposite of strong?", "weak"),
    ("words", "What is the opposite of rich?", "poor"),
    ("words", "What is the opposite of up?", "down"),
    ("words", "What is the opposite of day?", "night"),
    ("words", "What is the plural of mouse?", "mice"),
    ("words", "What is the plural of child?", "children"),
    ("words", "What is the plural of tooth?", "teeth"),
    ("words", "What is the plural of goose?", "geese"),
    ("words", "What is the plural of woman?", "women"),
    ("words", "What is the past tense of go?", "went"),
    ("words", "What is the past tense of eat?", "ate"),
    ("words", "What is the past tense of swim?", "swam"),
    ("words", "What is the past tense of write?", "wrote"),
    ("words", "What do you call a person who flies an aeroplane?", "pilot"),
    ("words", "What do you call a doctor who treats animals?", "vet|veterinarian|veterinary"),
    ("words", "What do you call a person who cooks in a restaurant?", "chef|cook"),
    ("words", "What do you call a person who writes poems?", "poet"),
    ("words", "What is a word that describes a noun called?", "adjective"),
    ("words", "What do you call a person who grows crops on a farm?", "farmer"),
    ("everyday", "What colour is a ripe banana?", "yellow"),
    ("everyday", "What colour do you get when you mix blue and yellow?", "green"),
    ("everyday", "What colour do you get when you mix red and white?", "pink"),
    ("everyday", "What colour do you get when you mix red and yellow?", "orange"),
    ("everyday", "What colour is coal?", "black"),
    ("everyday", "What colour is fresh milk?", "white"),
    ("everyday", "What do you use to cut paper?", "scissors"),
    ("everyday", "What do people write with on a blackboard?", "chalk"),
    ("everyday", "Which meal do people eat in the morning?", "breakfast"),
    ("everyday", "Which fruit is wine usually made from?", "grape|grapes"),
    ("everyday", "What is bread mainly made from?", "flour|wheat"),
    ("everyday", "What do you use to unlock a door?", "key|keys"),
    ("everyday", "Which day comes after Monday?", "Tuesday"),
    ("everyday", "Which month comes after March?", "April"),
    ("everyday", "What is the first month of the year?", "January"),
    ("everyday", "Which season comes after winter?", "spring"),
    ("everyday", "In which room of a house do people usually cook?", "kitchen"),
    ("everyday", "Which vegetable often makes people cry when they cut it?", "onion|onions"),
    ("everyday", "What do you look through to see distant stars?", "telescope"),
    ("everyday", "Which sport is played at Wimbledon?", "tennis"),
    ("everyday", "Which board game has kings, queens, bishops and knights?", "chess"),
    ("everyday", "How many wheels does a bicycle have?", 2),
    ("everyday", "What is the main ingredient of guacamole?", "avocado|avocados"),
    ("everyday", "How many players does a football team have on the field?", 11),
    ("everyday", "What do you call the money paid each month to live in a rented flat?", "rent"),
    ("everyday", "What do bees collect from flowers?", "nectar|pollen"),
]  # fmt: skip

#: Names that are no common English word (a reply saying "will" names no one).
NAMES = """Anna Ben Clara David Emma Felix Hugo Lena Marco Nora Omar Paula Quinn Rosa Tara Umar Vera Yara Zoe Leo
Mia Noah Ella Theo Oscar Adam Lucy Hana Ravi Sofia Tom Kira""".split()
ANIMALS = {"dog": "dogs", "cat": "cats", "rabbit": "rabbits", "parrot": "parrots", "hamster": "hamsters"}
THINGS = "apples oranges pencils stickers marbles cookies books cards stamps shells eggs balloons".split()
TOPICS = """the sea|autumn|a cat|coffee|a big city|rain|music|a garden|friendship|breakfast|the mountains|a train
journey|winter|books|football|the moon|a bicycle|a forest|chocolate|a river|summer|a library|bread|snow|a dog|the
sun|flowers|a market|an old house|the night sky|a birthday party|a bridge|tea|a storm|the desert|an island|a kitchen
|a school|a park|the wind|a lake|a farm|spring|a museum|a bakery|the beach|a zoo|an airport""".replace("\n", " ")
TOPICS_L = [" ".join(t.split()) for t in TOPICS.split("|")]
KINDS_ONE = """fruit|colour|animal|vegetable|musical instrument|flower|sport|planet|metal|tree|bird|month|drink|
vehicle|day of the week|ocean|insect|shape|season|fish|gemstone|spice|dance|board game""".replace("\n", "")
WORDS_REQ = "blue happy morning quiet bright river window gentle golden laugh".split()
STARTS = ["Today", "Yes", "Every", "My", "When", "Sometimes", "Once", "In"]
LANGS = {"fr": "French", "es": "Spanish", "de": "German"}
TOWNS = """Millbrook Ashford Pinehill Redwater Oakvale Stonebridge Elmwood Fairhaven Greystone Willowby Brookside
Clearwater Foxton Highmoor Kingsley Larkfield Northcote Riverton Southwick Thornbury""".split()


def norm(prompt: str) -> str:
    return " ".join(re.sub(r"[^\w]+", " ", prompt.lower()).split())


def excluded() -> set[str]:
    """Normalised prompts the project trains or demonstrates on: the probes, the live loop's ``PROMPTS``, and the
    quoted questions and prompts of README.md and docs/."""
    out = {norm(json.loads(line)["prompt"]) for line in (RAILS / "probes.jsonl").read_text().splitlines() if line}
    tree = ast.parse((REPO / "bench" / "live_loop.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "PROMPTS" for t in node.targets):
            out |= {norm(p) for p in ast.literal_eval(node.value)}
    for page in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        for quoted in re.findall(r"[\"'`]([^\"'`\n]{6,200})[\"'`]", page.read_text()):
            out.add(norm(quoted))
    return out


def split(rows: list, seed: str, share: float = GATE_SHARE) -> tuple[list, list]:
    rows = list(rows)
    random.Random(seed).shuffle(rows)
    k = round(len(rows) * share)
    return rows[:k], rows[k:]


def fact_items() -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {"gate": [], "bench": []}
    for domain in dict.fromkeys(d for d, _, _ in FACTS):
        rows = [r for r in FACTS if r[0] == domain]
        for name, part in zip(("gate", "bench"), split(rows, f"fact:{domain}")):
            for _, prompt, answer in part:
                if isinstance(answer, int):
                    check = {"kind": "number", "value": answer}
                else:
                    check = {"kind": "contains", "accept": [a.lower() for a in answer.split("|")]}
                out[name].append({"category": "fact", "prompt": prompt, "check": check, "source": f"table:{domain}"})
    return out


def arithmetic_items(rng: random.Random, sizes: dict[str, int]) -> dict[str, list[dict]]:
    """Single operations (about 55 %) and one-step word problems; no (operation, operands) pair in two items."""
    used: set[tuple] = set()

    def pick(op: str, lo: int, hi: int) -> tuple[int, int]:
        while True:
            a, b = rng.randint(lo, hi), rng.randint(lo, hi)
            if op[0] in "-/" and a < b:
                a, b = b, a
            if a != b and (op, a, b) not in used:
                used.add((op, a, b))
                return a, b

    def one(i: int) -> dict:
        kind = i % 9
        name, thing = rng.choice(NAMES), rng.choice(THINGS)
        if kind == 0:
            a, b = pick("+", 4, 60)
            p, v, t = rng.choice([f"What is {a} + {b}?", f"What is {a} plus {b}?", f"Add {a} and {b}."]), a + b, "add"
        elif kind == 1:
            a, b = pick("-", 3, 60)
            p, v, t = (
                rng.choice([f"What is {a} - {b}?", f"What is {a} minus {b}?", f"Subtract {b} from {a}."]),
                a - b,
                "sub",
            )
        elif kind == 2:
            a, b = pick("*", 2, 12)
            p, v, t = (
                rng.choice([f"What is {a} times {b}?", f"What is {a} × {b}?", f"Multiply {a} by {b}."]),
                a * b,
                "mul",
            )
        elif kind == 3:
            a, b = pick("/", 2, 12)
            p, v, t = rng.choice([f"What is {a * b} divided by {b}?", f"What is {a * b} / {b}?"]), a, "div"
        elif kind == 4:
            a, b = pick("+", 3, 40)
            p, v, t = f"What is the sum of {a} and {b}?", a + b, "add"
        elif kind == 5:
            a, b = pick("+w", 3, 30)
            p = f"{name} has {a} {thing}. Then {name} gets {b} more. How many {thing} does {name} have now?"
            v, t = a + b, "word-add"
        elif kind == 6:
            a, b = pick("-w", 4, 40)
            p = f"{name} had {a} {thing} and gave {b} of them away. How many {thing} does {name} have left?"
            v, t = a - b, "word-sub"
        elif kind == 7:
            a, b = pick("*w", 2, 9)
            p = f"There are {a} bags with {b} {thing} in each bag. How many {thing} are there in total?"
            v, t = a * b, "word-mul"
        else:
            a, b = pick("/w", 2, 9)
            p = f"{name} shares {a * b} {thing} equally among {b} friends. How many {thing} does each friend get?"
            v, t = a, "word-div"
        return {
            "category": "arithmetic",
            "prompt": p,
            "check": {"kind": "number", "value": v},
            "source": f"template:arith-{t}",
        }

    return {name: [one(i) for i in range(n)] for name, n in sizes.items()}


def instruction_items(rng: random.Random, sizes: dict[str, int]) -> dict[str, list[dict]]:
    """Checkable constraints; every topic, thing kind and required word is in one set only."""
    topics = dict(zip(("gate", "bench"), split(TOPICS_L, "topics")))
    kinds = dict(zip(("gate", "bench"), split(KINDS_ONE.split("|"), "kinds")))
    words = dict(zip(("gate", "bench"), split(WORDS_REQ, "words")))
    out = {}
    for name, n in sizes.items():
        tq, kq, wq = list(topics[name]), list(kinds[name]), list(words[name])
        rows = []
        for i in range(n):
            topic, thing, word = tq[i % len(tq)], kq[i % len(kq)], wq[i % len(wq)]
            kind = i % 11
            if kind == 0:
                article = "an" if thing[0] in "aeiou" else "a"
                p, c = f"Name {article} {thing}. Answer with one word only.", {"kind": "one_word"}
            elif kind == 1:
                k = 2 + i % 4
                p, c = f"Give exactly {k} bullet points about {topic}.", {"kind": "bullets", "n": k}
            elif kind == 2:
                lang = list(LANGS)[i % 3]
                p = rng.choice(
                    [
                        f"Write two sentences about {topic} in {LANGS[lang]}.",
                        f"Answer in {LANGS[lang]}: what do you like about {topic}?",
                    ]
                )
                c = {"kind": "language", "lang": lang}
            elif kind == 3:
                p = (
                    f'Reply with a JSON object with the keys "name" and "colour" describing {topic}. '
                    f"Output only the JSON."
                )
                c = {"kind": "json", "keys": ["name", "colour"]}
            elif kind == 4:
                p, c = (
                    f'Write one sentence about {topic} that uses the word "{word}".',
                    {"kind": "required_word", "word": word},
                )
            elif kind == 5:
                p, c = f"Write one sentence about {topic} using only lowercase letters.", {"kind": "lowercase"}
            elif kind == 6:
                p, c = f"Write a short sentence about {topic} in capital letters only.", {"kind": "all_caps"}
            elif kind == 7:
                k = (5, 8, 10)[i % 3]
                p, c = f"Describe {topic} in at most {k} words.", {"kind": "max_words", "n": k}
            elif kind == 8:
                w = STARTS[i % len(STARTS)]
                p, c = (
                    f'Write a sentence about {topic} that starts with the word "{w}".',
                    {"kind": "starts_with", "text": w},
                )
            elif kind == 9:
                p = f"In all lowercase letters and at most 10 words, describe {topic}."
                c = {"kind": "all_of", "checks": [{"kind": "lowercase"}, {"kind": "max_words", "n": 10}]}
            else:
                p = f"Give a JSON list of three {thing} names and nothing else."
                c = {"kind": "json", "type": "array"}
            rows.append({"category": "instruction", "prompt": p, "check": c, "source": f"template:instr-{c['kind']}"})
        out[name] = rows
    return out


def reading_items(rng: random.Random, sizes: dict[str, int]) -> dict[str, list[dict]]:
    """A 2-4 sentence made-up passage (fictional names and towns) and a question answered in it. A passage names
    a second value of the asked kind (another pet, colour, job, ...), rejected in the reply: a reply that only
    repeats the passage names both and is wrong."""

    def two(options: list[str]) -> list[str]:
        return rng.sample(options, 2)

    def passage(i: int) -> tuple[str, str, str | int, str | None]:
        (name, other), town = two(NAMES), rng.choice(TOWNS)
        pet, pet2 = two(["Biscuit", "Pepper", "Shadow", "Maple", "Ziggy", "Noodle", "Pip", "Comet", "Bramble"])
        day, day2 = two(["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"])
        colour, colour2 = two(["red", "blue", "green", "yellow", "purple", "orange", "white", "black"])
        food = rng.choice(["bread", "cheese", "apples", "honey", "soup", "rice", "carrots", "fish"])
        job, job2 = two(["teacher", "baker", "nurse", "pilot", "farmer", "painter", "driver", "chef"])
        t = i % 8
        if t == 0:
            text = (
                f"{name} lives in {town} with a dog called {pet} and a cat called {pet2}. "
                f"Every {day} they walk to the market, where {name} buys {food}."
            )
            q = [
                (f"What is the name of {name}'s dog?", pet, pet2),
                (f"What does {name} buy at the market?", food, None),
            ]
        elif t == 1:
            h = rng.randint(6, 10)
            text = (
                f"The small shop in {town} opens at {h} o'clock every morning. It is run by {name}, who used to work "
                f"as a {job}. {name}'s friend {other} works there too and used to be a {job2}."
            )
            q = [("Who runs the shop?", name, other), (f"What did {name} work as before?", job, job2)]
        elif t == 2:
            n, k = rng.randint(6, 12), rng.randint(2, 5)
            fruit, fruit2 = two(["cherry", "plum", "lemon", "pear", "peach"])
            text = (
                f"{name} planted {n} {fruit} trees last spring. Only {k} of them survived the dry summer. "
                f"Next year {name} wants to plant {fruit2} trees instead."
            )
            q = [
                ("How many of the trees survived?", k, None),
                (f"Which trees did {name} plant last spring?", fruit, fruit2),
            ]
        elif t == 3:
            month, month2 = two(["March", "April", "May", "June", "July", "September", "October"])
            text = (
                f"The music festival will be held in {town} in {month}. Last year it took place in {month2}. "
                f"The main singer is {name}, and {other} plays the drums."
            )
            q = [("In which month is the festival this year?", month, month2), ("Who is the main singer?", name, other)]
        elif t == 4:
            text = (
                f"{name} works as a {job} in {town} and drives a {colour} car. "
                f"{name}'s neighbour {other} is a {job2} with a {colour2} car."
            )
            q = [(f"What is {name}'s job?", job, job2), (f"What colour is {other}'s car?", colour2, colour)]
        elif t == 5:
            place = rng.choice(["library", "station", "bakery", "river", "school", "park"])
            text = (
                f"A small cat named {pet} was found near the {place} in {town}. It wore a {colour} collar with a "
                f"{colour2} bell. A neighbour called {name} took it home and gave it some {food}."
            )
            q = [("What colour was the cat's collar?", colour, colour2), (f"Where was {pet} found?", place, None)]
        elif t == 6:
            transport, transport2 = two(["train", "boat", "bus", "car", "plane"])
            text = (
                f"Last summer, {name} travelled to {town} by {transport}, and {other} followed two days later by "
                f"{transport2}. Every evening they ate {food} by the lake."
            )
            q = [(f"How did {name} travel to {town}?", transport, transport2), ("Who arrived later?", other, name)]
        else:
            members = rng.randint(5, 30)
            subject, subject2 = two(["birds", "space", "the ocean", "castles", "volcanoes", "trains"])
            text = (
                f"The reading club of {town} meets every {day}, and the chess club every {day2}. The reading club "
                f"has {members} members. Last month it read a book about {subject2}; this month it reads one "
                f"about {subject}."
            )
            q = [
                ("On which day does the reading club meet?", day, day2),
                ("What is this month's book about?", subject.removeprefix("the "), subject2.removeprefix("the ")),
            ]
        question, answer, distractor = rng.choice(q)
        return text, question, answer, distractor

    out: dict[str, list[dict]] = {}
    for name, n in sizes.items():
        rows = []
        for i in range(n):
            text, question, answer, distractor = passage(i)
            if isinstance(answer, int):
                check: dict = {"kind": "number", "value": answer}
            else:
                check = {"kind": "contains", "accept": [answer.lower()]}
                if distractor:
                    check["reject"] = [distractor.lower()]
            prompt = f"Read the text and answer the question.\n\nText: {text}\n\nQuestion: {question}"
            rows.append(
                {"category": "reading", "prompt": prompt, "check": check, "source": f"template:reading-{i % 8}"}
            )
        out[name] = rows
    return out


def build() -> dict[str, list[dict]]:
    """``{"gate": rows, "bench": rows}``: each row a :class:`~livelora.trainer.capability.CapabilityItem` dict."""
    rng = random.Random(45)
    sets = fact_items()
    for part in (
        arithmetic_items(rng, {k: v["arithmetic"] for k, v in SIZES.items()}),
        instruction_items(rng, {k: v["instruction"] for k, v in SIZES.items()}),
        reading_items(rng, {k: v["reading"] for k, v in SIZES.items()}),
    ):
        for name in sets:
            sets[name] += part[name]
    skip, seen = excluded(), set()
    for name, rows in sets.items():
        kept, counts = [], {}
        for row in rows:
            key = norm(row["prompt"])
            if key in skip or key in seen:
                continue
            seen.add(key)
            counts[row["category"]] = counts.get(row["category"], 0) + 1
            row["id"] = f"{name}-{row['category']}-{counts[row['category']]:03d}"
            row["max_tokens"] = MAX_TOKENS[row["category"]]
            kept.append(row)
        sets[name] = kept
    return sets


def _home() -> Path:
    import os

    return Path(os.environ.get("LIVELORA_HOME") or REPO / ".livelora-home")


def generate(rows: list[dict], cache: Path, batch: int = 16) -> None:
    """Greedy reply token ids of the base model to each row not yet in ``cache`` (``{prompt: ids}``, written after
    each batch, so that a run can stop and go on): chat template with its default system message, no forced lead,
    :data:`GEN_TOKENS` of its category at most, in ``rows`` order (64 rows at a time, batched by category)."""
    import torch

    from livelora.core.base_models import load_model, load_tokenizer, resolve_base_model
    from livelora.core.settings import DEFAULT_MODEL

    done = json.loads(cache.read_text()) if cache.is_file() else {}
    todo = [r for r in rows if r["prompt"] not in done]
    ref = resolve_base_model(DEFAULT_MODEL, _home())
    tok, model = load_tokenizer(ref), load_model(ref)
    eos, pad = tok.eos_token_id, tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    window = [todo[i : i + 64] for i in range(0, len(todo), 64)]
    parts = [
        sorted(same, key=lambda r: len(r["prompt"]))[j : j + batch]
        for w in window
        for c in CATEGORIES
        if (same := [r for r in w if r["category"] == c])
        for j in range(0, len(same), batch)
    ]
    for part in parts:
        ids = [
            tok.encode(
                tok.apply_chat_template(
                    [{"role": "user", "content": r["prompt"]}], add_generation_prompt=True, tokenize=False
                ),
                add_special_tokens=False,
            )
            for r in part
        ]
        width = max(map(len, ids))
        x = torch.tensor([[pad] * (width - len(s)) + s for s in ids])
        mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in ids])
        with torch.no_grad():
            out = model.generate(
                input_ids=x,
                attention_mask=mask,
                max_new_tokens=GEN_TOKENS[part[0]["category"]],
                do_sample=False,
                pad_token_id=pad,
                eos_token_id=eos,
            )
        for r, row in zip(part, out[:, width:].tolist()):
            done[r["prompt"]] = row[: row.index(eos)] if eos in row else row
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(done))
        print(f"replies: {len(done)} cached, {sum(r['prompt'] not in done for r in todo)} to go", flush=True)


def calibrate(sets: dict[str, list[dict]], cache: Path, dump: Path) -> None:
    """Set the ``max_tokens`` of each row with a cached base-model reply (:func:`generate`) and print the base
    model's accuracy per category at those limits; ``dump`` gets every judged reply, to read."""
    from livelora.core.base_models import load_tokenizer, resolve_base_model
    from livelora.core.settings import DEFAULT_MODEL

    tok = load_tokenizer(resolve_base_model(DEFAULT_MODEL, _home()))
    cached = json.loads(cache.read_text())
    listing = []
    for name, rows in sets.items():
        need: dict[str, int] = {}
        measured = [r for r in rows if r["prompt"] in cached]
        for r in measured:
            item, ids = _item(r), cached[r["prompt"]]
            if item.right(tok.decode(ids, skip_special_tokens=True)):
                n = next(n for n in range(1, len(ids) + 1) if item.right(tok.decode(ids[:n], skip_special_tokens=True)))
                need[r["id"]] = n
        by_kind: dict[str, list[int]] = {}
        for r in measured:
            if r["id"] in need:
                by_kind.setdefault(_kind(r), []).append(_limit(r, need[r["id"]]))
        right: dict[str, list[bool]] = {}
        for r in measured:
            fallback = sorted(by_kind.get(_kind(r)) or [FLOOR[r["category"]]])
            r["max_tokens"] = _limit(r, need[r["id"]]) if r["id"] in need else fallback[(len(fallback) * 3) // 4]
            item, ids = _item(r), cached[r["prompt"]]
            text = tok.decode(ids[: r["max_tokens"]], skip_special_tokens=True)
            ok = item.right(text) and item.right(tok.decode(ids, skip_special_tokens=True))
            right.setdefault(r["category"], []).append(ok)
            listing.append(
                {
                    "id": r["id"],
                    "right": ok,
                    "max_tokens": r["max_tokens"],
                    "prompt": r["prompt"],
                    "check": r["check"],
                    "reply": text,
                }
            )
        every = [x for v in right.values() for x in v]
        shares = {c: f"{sum(v)}/{len(v)} = {sum(v) / len(v):.0%}" for c, v in right.items()}
        score = f"{sum(every)}/{len(every)} = {sum(every) / max(len(every), 1):.1%}"
        print(f"{name}: {len(measured)} of {len(rows)} items measured; base right {score}; {shares}")
        print(f"{name}: max_tokens mean {sum(r['max_tokens'] for r in rows) / len(rows):.1f}")
    dump.write_text(json.dumps(listing, indent=1, ensure_ascii=False))


def _item(row: dict) -> CapabilityItem:
    return CapabilityItem(**{k: row[k] for k in ("id", "category", "prompt", "check", "max_tokens", "source")})


def _kind(row: dict) -> str:
    return f"{row['category']}:{row['check']['kind']}"


def _limit(row: dict, need: int) -> int:
    """A right reply's token need plus a margin (a bullet list's next line must show), in steps of 8."""
    margin = 16 if row["check"]["kind"] == "bullets" else 6
    return min(GEN_TOKENS[row["category"]], max(FLOOR[row["category"]], -(-(need + margin) // 8) * 8))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--generate", action="store_true", help="cache the base model's replies in bench/out/ (slow)")
    ap.add_argument("--calibrate", action="store_true", help="set max_tokens from the cached replies")
    ap.add_argument("--out", type=Path, default=RAILS)
    args = ap.parse_args()
    sets = build()
    for name, rows in sets.items():  # keep the shipped calibration of an unchanged item
        shipped = RAILS / f"freeform_{name}.jsonl"
        old = {d["id"]: d for d in map(json.loads, shipped.read_text().splitlines())} if shipped.is_file() else {}
        for r in rows:
            if (o := old.get(r["id"])) and o["prompt"] == r["prompt"] and o["check"] == r["check"]:
                r["max_tokens"] = o["max_tokens"]
    out = REPO / "bench" / "out"
    if args.generate:
        by_id = {r["id"]: r for rows in sets.values() for r in rows}
        order = [by_id[i.id] for rows in sets.values() for i in stratified([_item(r) for r in rows])]
        generate(order, out / "freeform_base_replies.json")
        return
    if args.calibrate:
        calibrate(sets, out / "freeform_base_replies.json", out / "freeform_base_judged.json")
    for name, rows in sets.items():
        path = args.out / f"freeform_{name}.jsonl"
        keys = ("id", "category", "prompt", "check", "max_tokens", "source")
        path.write_text("".join(json.dumps({k: r[k] for k in keys}, ensure_ascii=False) + "\n" for r in rows))
        cats = {c: sum(r["category"] == c for r in rows) for c in CATEGORIES}
        print(f"{path}: {len(rows)} items {cats}")


if __name__ == "__main__":
    main()
