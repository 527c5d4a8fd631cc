"""Slide-deck search: an invented corpus of slides, questions about it, and gold search trajectories.

Everything is a deterministic function of the seed (the same seed gives byte-identical files),
and every fact is invented (project, person and company names, numbers, dates), so a model can
only answer by searching. Each deck is one project; each slide is a title plus 3-4
`Label: value` bullets. A question asks for one fact (evidence on one slide) or compares a
number between two projects (evidence on two slides). Questions name the project and the fact,
so a keyword (BM25) search for "<project> <label>" puts the gold slide first.

Train and held-out questions never overlap: a question's split is fixed by a hash of its key.

Files written by `grouprl.rollout.gold.write_slides_task(out_dir, ...)` (or `python -m grouprl.rollout.gold
--out DIR`); all but the gold trajectories by `grouprl.data.tasks.slides_files.write_slides_data`:
- `corpus.jsonl`: one slide a line, `{id, title, text, image}` (text: the bullet lines; image:
  path relative to out_dir), the retriever's corpus format;
- `images/<id>.png`: the slide drawn with Pillow (title, bullets, slide number);
- `train.parquet`, `val.parquet`: verl layout (`prompt` = the user question alone: the agent
  loop adds its protocol system prompt; `reward_model.ground_truth`; `extra_info: {uid, index,
  split, kind, gold_docs, gold_queries, seed}`), read by `load_samples`;
- `sft_train.jsonl`, `sft_val.jsonl`: gold trajectories (see `grouprl.rollout.gold`).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import NamedTuple

from grouprl.data.sample import Sample
from grouprl.errors import ConfigError

DATA_SOURCE = "grouprl/slides"
SPLITS = ("train", "val")
VAL_SHARE = 5  # one question key in VAL_SHARE (by hash) is held out
TOP_K = 3  # search hits shown in an observation of a gold trajectory (agent.retriever.top_k)

# -- what the slides are made of ----------------------------------------------------------
SYLLABLES = tuple(
    "vel mo ra quil fern tar wick zan dor bri sol ka thra nix lu mer ost vane cor pel dra gon ish tal".split()
)
FIRST_NAMES = tuple(
    "Mara Ivo Selka Tomas Ines Oren Lidia Bram Yuki Anouk Dario Freya Kasimir Nadia Piet Rosalind Sven Talia Ugo Wren".split()
)
LAST_NAMES = tuple(
    "Quell Marrow Ostby Vance Lindqvist Perrault Hale Brandt Okafor Sato Duarte Kowal Achebe Nygaard Ferro Tan "
    "Wilde Moreau Ibsen Roy".split()
)
CITIES = tuple(
    "Oslo Lisbon Nairobi Osaka Montreal Tallinn Porto Seoul Austin Krakow Lyon Bergen Cork Ghent Leeds Malmo "
    "Quito Perth Turin Utrecht".split()
)
COMPANY_SUFFIXES = ("Labs", "Systems", "Works", "Partners", "Logistics", "Analytics", "Robotics")
POOLS = {
    "risk": (
        "chip shortage",
        "regulatory review",
        "data migration",
        "currency swings",
        "vendor lock-in",
        "key staff turnover",
        "cloud cost growth",
        "patent dispute",
    ),
    "expense": (
        "cloud hosting",
        "field trials",
        "contractor fees",
        "hardware prototypes",
        "licensing",
        "travel",
    ),
    "milestone": ("public API", "mobile app", "EU rollout", "partner portal", "offline mode", "SOC 2 report"),
}
NUMERIC_KINDS = ("money", "count", "percent")  # the kinds a comparison question may ask about


class FactSpec(NamedTuple):
    """One bullet of a slide type: `label: value`, asked about as "the <noun> of project X"."""

    label: str
    kind: str  # money, count, percent, person, date, city, company, uptime, latency, version, or a POOLS key
    low: int = 0  # range of a "count"
    high: int = 0
    noun: str = ""  # how a question names it when the label does not read as a noun ("" = the label)


SLIDE_TYPES: dict[str, tuple[FactSpec, ...]] = {
    "Overview": (
        FactSpec("Sponsor", "person"),
        FactSpec("Founding date", "date"),
        FactSpec("Headquarters", "city"),
        FactSpec("Parent company", "company"),
    ),
    "Budget": (
        FactSpec("Total budget", "money"),
        FactSpec("Budget owner", "person"),
        FactSpec("Contingency reserve", "percent"),
        FactSpec("Largest expense", "expense"),
    ),
    "Timeline": (
        FactSpec("Kickoff date", "date"),
        FactSpec("Beta release date", "date"),
        FactSpec("Launch date", "date"),
    ),
    "Team": (
        FactSpec("Team size", "count", 5, 80),
        FactSpec("Engineering lead", "person"),
        FactSpec("Design lead", "person"),
        FactSpec("Main office", "city"),
    ),
    "Customers": (
        FactSpec("Pilot customers", "count", 3, 60, "number of pilot customers"),
        FactSpec("Largest customer", "company"),
        FactSpec("Renewal rate", "percent"),
    ),
    "Risks": (
        FactSpec("Top risk", "risk"),
        FactSpec("Risk owner", "person"),
        FactSpec("Mitigation deadline", "date"),
    ),
    "Metrics": (
        FactSpec("Monthly active users", "count", 1000, 90000, "number of monthly active users"),
        FactSpec("Uptime", "uptime"),
        FactSpec("Median latency", "latency"),
    ),
    "Suppliers": (
        FactSpec("Main supplier", "company"),
        FactSpec("Contract value", "money"),
        FactSpec("Contract end date", "date"),
    ),
    "Hiring": (
        FactSpec("Open roles", "count", 2, 40, "number of open roles"),
        FactSpec("Recruiter", "person"),
        FactSpec("Hiring deadline", "date"),
    ),
    "Roadmap": (
        FactSpec("Next milestone", "milestone"),
        FactSpec("Milestone date", "date"),
        FactSpec("Current version", "version"),
    ),
    "Security": (
        FactSpec("Last audit date", "date"),
        FactSpec("Auditor", "company"),
        FactSpec("Open findings", "count", 0, 25, "number of open findings"),
    ),
    "Sales": (
        FactSpec("Quarterly revenue", "money"),
        FactSpec("Sales lead", "person"),
        FactSpec("Deals closed", "count", 4, 120, "number of deals closed"),
    ),
}

QUESTION_FORMS = (
    "{wh} the {label} of project {deck}?",
    "According to the {deck} deck, {wh_lower} the {label}?",
    "In the slides about {deck}, {wh_lower} the {label}?",
    "{wh} listed as the {label} for {deck}?",
)
COMPARE_FORMS = (
    "Which project has the higher {label}: {a} or {b}?",
    "Between {a} and {b}, which project reports the higher {label}?",
    "Is the {label} higher for {a} or for {b}?",
)
QUERY_FORMS = ("{deck} {label}", "{label} {deck}", "{deck} {label} {slide}")
FIRST_THOUGHTS = (
    "The question asks for the {noun} of {deck}. I will search the {deck} slides.",
    "I need the {noun} from the {deck} deck.",
    "This should be on the {slide} slide of {deck}.",
)
FOUND_THOUGHTS = (
    "{doc} ({title}) lists {label}: {value}. That is the evidence.",
    "The {slide} slide of {deck} gives {label}: {value}.",
    "Found it: {doc} says {label} is {value}.",
)


@dataclass(frozen=True)
class Fact:
    slide_id: str
    deck: str
    slide: str  # slide type, e.g. "Budget"
    label: str
    kind: str
    value: str  # as printed on the slide and given as the answer
    number: float | None  # for comparisons
    noun: str  # how questions name it


@dataclass(frozen=True)
class Slide:
    id: str  # "<deck index>-s<number>", e.g. "d03-s05"
    deck: str  # project name
    number: int
    count: int  # slides in the deck
    title: str
    bullets: tuple[str, ...]

    @property
    def text(self) -> str:
        """The bullets, one `- label: value` line each (the corpus keeps the title apart)."""
        return "\n".join(f"- {b}" for b in self.bullets)


@dataclass(frozen=True)
class Question:
    key: str  # stable identity, fixes the split
    kind: str  # "single" or "compare"
    question: str
    answer: str
    facts: tuple[Fact, ...]  # one per gold slide, in search order


# -- the corpus ---------------------------------------------------------------------------
def _name(rng: random.Random) -> str:
    return "".join(rng.sample(SYLLABLES, 2)).capitalize()


def _value(rng: random.Random, spec: FactSpec, names: list[str]) -> str:
    """A random value of the fact's kind, as printed on the slide."""
    kind = spec.kind
    if kind == "money":
        return f"${rng.randint(12, 990) / 10:.1f}M"
    if kind == "count":
        return str(rng.randint(spec.low, spec.high))
    if kind == "percent":
        return f"{rng.randint(3, 95)}%"
    if kind == "person":
        return f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}"
    if kind == "date":
        return f"{rng.randint(2021, 2027)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    if kind == "city":
        return rng.choice(CITIES)
    if kind == "company":
        return f"{rng.choice(names)} {rng.choice(COMPANY_SUFFIXES)}"
    if kind == "uptime":
        return f"{rng.randint(950, 999) / 10:.1f}%"
    if kind == "latency":
        return f"{rng.randint(20, 400)} ms"
    if kind == "version":
        return f"v{rng.randint(1, 6)}.{rng.randint(0, 9)}"
    return rng.choice(POOLS[kind])


def make_corpus(seed: int, *, n_decks: int = 12, slides_per_deck: tuple[int, int] = (7, 11)) -> list[Slide]:
    """`n_decks` decks of slides_per_deck[0]..[1] slides, Overview first, then other types in random order."""
    low, high = slides_per_deck
    if not 2 <= low <= high <= len(SLIDE_TYPES):
        raise ConfigError(
            f"slides_per_deck must satisfy 2 <= min <= max <= {len(SLIDE_TYPES)}, got {slides_per_deck}"
        )
    if not 1 <= n_decks <= 60:
        raise ConfigError(f"n_decks must be between 1 and 60, got {n_decks}")
    rng = random.Random(f"{DATA_SOURCE}/corpus/{seed}")
    decks: list[str] = []
    while len(decks) < n_decks:
        name = _name(rng)
        if name not in decks:
            decks.append(name)
    company_names: list[str] = []
    while len(company_names) < 12:  # never a project's name: a search for the project must not find them
        name = _name(rng)
        if name not in decks and name not in company_names:
            company_names.append(name)
    others = [t for t in SLIDE_TYPES if t != "Overview"]
    slides: list[Slide] = []
    for d, deck in enumerate(decks):
        types = ["Overview"] + rng.sample(others, rng.randint(low, high) - 1)
        for number, slide_type in enumerate(types, start=1):
            bullets = [
                f"{spec.label}: {_value(rng, spec, company_names)}" for spec in SLIDE_TYPES[slide_type]
            ]
            slides.append(
                Slide(
                    f"d{d:02d}-s{number:02d}",
                    deck,
                    number,
                    len(types),
                    f"{deck}: {slide_type}",
                    tuple(bullets),
                )
            )
    return slides


def slide_facts(slide: Slide) -> list[Fact]:
    """The facts printed on a slide, parsed back from its bullets (the slide is the source of truth)."""
    slide_type = slide.title.split(": ", 1)[1]
    facts = []
    for bullet, spec in zip(slide.bullets, SLIDE_TYPES[slide_type]):
        value = bullet.split(": ", 1)[1]
        number = float(value.strip("$M%")) if spec.kind in NUMERIC_KINDS else None
        facts.append(
            Fact(
                slide.id,
                slide.deck,
                slide_type,
                spec.label,
                spec.kind,
                value,
                number,
                (spec.noun or spec.label).lower(),
            )
        )
    return facts


# -- questions ----------------------------------------------------------------------------
def split_of(key: str) -> str:
    """The split a question belongs to, fixed by its key alone."""
    return "val" if int(hashlib.sha1(key.encode("utf-8")).hexdigest()[:8], 16) % VAL_SHARE == 0 else "train"


def _wh(kind: str) -> str:
    return "Who is" if kind == "person" else "What is"


def candidate_questions(slides: list[Slide]) -> list[Question]:
    """Every single-fact question and every two-project comparison the corpus supports, in a fixed order."""
    facts = [f for s in slides for f in slide_facts(s)]
    questions = []
    for i, f in enumerate(facts):
        key = f"single|{f.slide_id}|{f.label}"
        wh = _wh(f.kind)
        form = QUESTION_FORMS[i % len(QUESTION_FORMS)]
        text = form.format(wh=wh, wh_lower=wh.lower(), label=f.noun, deck=f.deck)
        questions.append(Question(key, "single", text[0].upper() + text[1:], f.value, (f,)))
    by_label: dict[str, list[Fact]] = {}
    for f in facts:
        if f.kind in NUMERIC_KINDS:
            by_label.setdefault(f.label, []).append(f)
    for label, group in by_label.items():
        for i, a in enumerate(group):
            for b in group[i + 1 :]:
                if a.number == b.number:
                    continue
                key = f"compare|{a.slide_id}|{b.slide_id}|{label}"
                form = COMPARE_FORMS[len(questions) % len(COMPARE_FORMS)]
                winner = a if a.number > b.number else b
                questions.append(
                    Question(
                        key, "compare", form.format(label=a.noun, a=a.deck, b=b.deck), winner.deck, (a, b)
                    )
                )
    return questions


def make_questions(
    slides: list[Slide], n: int, seed: int, split: str, *, two_slide_share: float = 0.2
) -> list[Question]:
    """`n` questions of `split`: round(n * two_slide_share) comparisons, the rest single-fact, shuffled."""
    if split not in SPLITS:
        raise ConfigError(f"slides split must be one of {', '.join(SPLITS)}, got {split!r}")
    if not 0 <= two_slide_share <= 1:
        raise ConfigError(f"two_slide_share must be in [0, 1], got {two_slide_share}")
    rng = random.Random(f"{DATA_SOURCE}/questions/{split}/{seed}")
    pool = [q for q in candidate_questions(slides) if split_of(q.key) == split]
    wanted = {"compare": round(n * two_slide_share)}
    wanted["single"] = n - wanted["compare"]
    chosen: list[Question] = []
    for kind in ("single", "compare"):
        of_kind = [q for q in pool if q.kind == kind]
        if len(of_kind) < wanted[kind]:
            raise ConfigError(
                f"the slides corpus has only {len(of_kind)} {kind} {split} questions, asked for {wanted[kind]}: "
                "add decks (n_decks) or ask for fewer"
            )
        chosen += rng.sample(of_kind, wanted[kind])
    rng.shuffle(chosen)
    return chosen


def gold_queries(question: Question, variant: int) -> list[str]:
    """One search query per gold slide: the project and the label (word order varies by `variant`)."""
    form = QUERY_FORMS[variant % len(QUERY_FORMS)]
    return [form.format(deck=f.deck, label=f.label.lower(), slide=f.slide.lower()) for f in question.facts]


def to_sample(question: Question, index: int, split: str, seed: int) -> Sample:
    """The question alone as the prompt: the agent loop puts its protocol system prompt in front."""
    uid = f"slides-{split}-{index:04d}"
    return Sample(
        uid=uid,
        messages=[{"role": "user", "content": question.question}],
        ground_truth=question.answer,
        data_source=DATA_SOURCE,
        extra_info={
            "uid": uid,
            "index": index,
            "split": split,
            "kind": question.kind,
            "gold_docs": [f.slide_id for f in question.facts],
            "gold_queries": gold_queries(question, 0),
            "seed": seed,
        },
    )


def make_slides(
    n: int,
    seed: int,
    split: str = "train",
    *,
    few_shot: bool = True,
    n_decks: int = 12,
    slides_per_deck: tuple[int, int] = (7, 11),
    two_slide_share: float = 0.2,
) -> list[Sample]:
    """`n` questions of `split` as Samples (the task registry's signature). The corpus they ask
    about is `make_corpus(seed, ...)`; write it with `write_slides_task`. `few_shot` is accepted
    for the registry and unused: the protocol prompt has no worked example."""
    del few_shot
    slides = make_corpus(seed, n_decks=n_decks, slides_per_deck=tuple(slides_per_deck))
    questions = make_questions(slides, n, seed, split, two_slide_share=two_slide_share)
    return [to_sample(q, i, split, seed) for i, q in enumerate(questions)]
