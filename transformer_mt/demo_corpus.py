"""Built-in demo data: a deterministic English->German corpus from a small hand-written grammar.

Every English sentence has exactly one German translation (the grammar never leaves a choice
open), yet getting it right needs real German grammar: gender and case on articles and
adjectives, weak/mixed/strong adjective endings, irregular plurals, verb agreement with
stem-vowel changes, separable verbs, "nicht" vs. "kein", verb-second and verb-final order.
All sentences and the lexicon were written for this project; only the standard library is used.

    python -m transformer_mt.demo_corpus data/demo --train 24000 --valid 500 --test 1000
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

# ----------------------------------------------------------------------------------------
# Lexicon
# ----------------------------------------------------------------------------------------


class Noun(NamedTuple):
    """A countable noun; `tags` say which verbs, prepositions and adjectives it goes with."""

    en: str
    en_pl: str
    de: str
    de_pl: str
    gender: str  # "m", "f" or "n"
    tags: frozenset[str]
    de_obl: str | None = None  # weak masculine nouns ("n-Deklination"): den/dem Jungen


def _noun(
    en: str, en_pl: str, de: str, de_pl: str, gender: str, tags: str, de_obl: str | None = None
) -> Noun:
    return Noun(en, en_pl, de, de_pl, gender, frozenset(tags.split()), de_obl)


NOUNS: tuple[Noun, ...] = (
    # people
    _noun("man", "men", "Mann", "Männer", "m", "person"),
    _noun("woman", "women", "Frau", "Frauen", "f", "person"),
    _noun("child", "children", "Kind", "Kinder", "n", "person"),
    _noun("boy", "boys", "Junge", "Jungen", "m", "person", de_obl="Jungen"),
    _noun("girl", "girls", "Mädchen", "Mädchen", "n", "person"),
    _noun("teacher", "teachers", "Lehrer", "Lehrer", "m", "person"),
    _noun("doctor", "doctors", "Arzt", "Ärzte", "m", "person"),
    _noun("student", "students", "Student", "Studenten", "m", "person", de_obl="Studenten"),
    _noun("neighbor", "neighbors", "Nachbar", "Nachbarn", "m", "person", de_obl="Nachbarn"),
    _noun("mother", "mothers", "Mutter", "Mütter", "f", "person"),
    _noun("father", "fathers", "Vater", "Väter", "m", "person"),
    _noun("friend", "friends", "Freund", "Freunde", "m", "person"),
    _noun("brother", "brothers", "Bruder", "Brüder", "m", "person"),
    _noun("sister", "sisters", "Schwester", "Schwestern", "f", "person"),
    _noun("farmer", "farmers", "Bauer", "Bauern", "m", "person", de_obl="Bauern"),
    _noun("king", "kings", "König", "Könige", "m", "person"),
    # animals
    _noun("dog", "dogs", "Hund", "Hunde", "m", "animal"),
    _noun("cat", "cats", "Katze", "Katzen", "f", "animal"),
    _noun("horse", "horses", "Pferd", "Pferde", "n", "animal"),
    _noun("mouse", "mice", "Maus", "Mäuse", "f", "animal"),
    _noun("bird", "birds", "Vogel", "Vögel", "m", "animal"),
    _noun("bear", "bears", "Bär", "Bären", "m", "animal", de_obl="Bären"),
    _noun("lion", "lions", "Löwe", "Löwen", "m", "animal", de_obl="Löwen"),
    _noun("monkey", "monkeys", "Affe", "Affen", "m", "animal", de_obl="Affen"),
    _noun("fox", "foxes", "Fuchs", "Füchse", "m", "animal"),
    _noun("goose", "geese", "Gans", "Gänse", "f", "animal"),
    # things
    _noun("book", "books", "Buch", "Bücher", "n", "thing readable openable"),
    _noun("letter", "letters", "Brief", "Briefe", "m", "thing readable openable"),
    _noun("newspaper", "newspapers", "Zeitung", "Zeitungen", "f", "thing readable"),
    _noun("ball", "balls", "Ball", "Bälle", "m", "thing toy"),
    _noun("key", "keys", "Schlüssel", "Schlüssel", "m", "thing tool"),
    _noun("knife", "knives", "Messer", "Messer", "n", "thing tool"),
    _noun("bag", "bags", "Tasche", "Taschen", "f", "thing openable"),
    _noun("box", "boxes", "Kiste", "Kisten", "f", "thing openable"),
    _noun("door", "doors", "Tür", "Türen", "f", "thing openable"),
    _noun("picture", "pictures", "Bild", "Bilder", "n", "thing"),
    _noun("flower", "flowers", "Blume", "Blumen", "f", "thing"),
    _noun("chair", "chairs", "Stuhl", "Stühle", "m", "thing furniture"),
    _noun("table", "tables", "Tisch", "Tische", "m", "thing furniture"),
    # vehicles
    _noun("car", "cars", "Auto", "Autos", "n", "vehicle"),
    _noun("bus", "buses", "Bus", "Busse", "m", "vehicle"),
    _noun("train", "trains", "Zug", "Züge", "m", "vehicle"),
    # food
    _noun("apple", "apples", "Apfel", "Äpfel", "m", "food"),
    _noun("egg", "eggs", "Ei", "Eier", "n", "food"),
    _noun("cake", "cakes", "Kuchen", "Kuchen", "m", "food"),
    _noun("banana", "bananas", "Banane", "Bananen", "f", "food"),
    _noun("potato", "potatoes", "Kartoffel", "Kartoffeln", "f", "food"),
    _noun("sausage", "sausages", "Wurst", "Würste", "f", "food"),
    # places
    _noun("house", "houses", "Haus", "Häuser", "n", "building"),
    _noun("school", "schools", "Schule", "Schulen", "f", "building"),
    _noun("station", "stations", "Bahnhof", "Bahnhöfe", "m", "building"),
    _noun("shop", "shops", "Laden", "Läden", "m", "building"),
    _noun("office", "offices", "Büro", "Büros", "n", "building"),
    _noun("kitchen", "kitchens", "Küche", "Küchen", "f", "room"),
    _noun("park", "parks", "Park", "Parks", "m", "area"),
    _noun("garden", "gardens", "Garten", "Gärten", "m", "area"),
    _noun("city", "cities", "Stadt", "Städte", "f", "area"),
    _noun("forest", "forests", "Wald", "Wälder", "m", "area"),
    _noun("village", "villages", "Dorf", "Dörfer", "n", "area"),
    _noun("river", "rivers", "Fluss", "Flüsse", "m", "water"),
    _noun("lake", "lakes", "See", "Seen", "m", "water"),
)


class Adjective(NamedTuple):
    """An adjective; `stem` takes the attributive endings (teuer -> teur-e), `de` is predicative."""

    en: str
    de: str
    stem: str
    tags: frozenset[str]  # noun tags it can describe


def _adj(en: str, de: str, tags: str, stem: str | None = None) -> Adjective:
    return Adjective(en, de, stem or de, frozenset(tags.split()))


_ANY = "person animal thing vehicle food building room area water"
ADJECTIVES: tuple[Adjective, ...] = (
    _adj("small", "klein", _ANY),
    _adj("big", "groß", _ANY),
    _adj("old", "alt", "person animal thing vehicle building room area"),
    _adj("young", "jung", "person animal"),
    _adj("new", "neu", "thing vehicle building room"),
    _adj("beautiful", "schön", "person animal thing vehicle building room area water"),
    _adj("red", "rot", "thing vehicle food"),
    _adj("blue", "blau", "thing vehicle"),
    _adj("green", "grün", "thing vehicle food"),
    _adj("black", "schwarz", "animal thing vehicle"),
    _adj("white", "weiß", "animal thing vehicle"),
    _adj("brown", "braun", "animal thing"),
    _adj("tired", "müde", "person animal", stem="müd"),
    _adj("hungry", "hungrig", "person animal"),
    _adj("friendly", "freundlich", "person animal"),
    _adj("clever", "klug", "person animal"),
    _adj("expensive", "teuer", "thing vehicle food", stem="teur"),
    _adj("heavy", "schwer", "thing"),
    _adj("fresh", "frisch", "food"),
    _adj("sweet", "süß", "food"),
    _adj("dark", "dunkel", "building room area", stem="dunkl"),
    _adj("cold", "kalt", "food room water"),
    _adj("warm", "warm", "food room water"),
)


class Verb(NamedTuple):
    """A verb with its English and German forms and what it combines with.

    German forms are (ich, er/sie/es, wir/sie); separable verbs store the particle apart
    ("ruft ... an", verb-final "anruft"). `pps` lists (English preposition, noun tags)."""

    en: str  # base form: "see", "pick"
    en3: str  # 3rd person singular: "sees", "picks"
    de: tuple[str, str, str]  # ich, er, wir/sie
    kind: str  # "tr", "ditr" (dative + accusative), "intr", "cop"
    subj: frozenset[str]
    obj: frozenset[str] = frozenset()
    iobj: frozenset[str] = frozenset()
    pps: tuple[tuple[str, frozenset[str]], ...] = ()
    en_particle: str = ""  # "pick up"
    de_particle: str = ""  # "abholen"
    de_animal: tuple[str, str, str] | None = None  # animals "fressen" instead of "essen"
    de_preps: tuple[tuple[str, str, str], ...] = ()  # verb-specific: wait for -> auf + Akk


def _verb(
    en: str,
    en3: str,
    de: str,
    kind: str,
    subj: str,
    obj: str = "",
    iobj: str = "",
    pps: tuple[tuple[str, str], ...] = (),
    **extra,
) -> Verb:
    ich, er, pl = de.split()
    return Verb(
        en,
        en3,
        (ich, er, pl),
        kind,
        frozenset(subj.split()),
        frozenset(obj.split()),
        frozenset(iobj.split()),
        tuple((p, frozenset(t.split())) for p, t in pps),
        **extra,
    )


_PLACES = "building room area"
VERBS: tuple[Verb, ...] = (
    # transitive: subject, accusative object, optional prepositional phrase
    _verb(
        "see",
        "sees",
        "sehe sieht sehen",
        "tr",
        "person animal",
        "person animal thing vehicle food",
        pps=(("in", _PLACES),),
    ),
    _verb("read", "reads", "lese liest lesen", "tr", "person", "readable", pps=(("in", _PLACES),)),
    _verb(
        "buy",
        "buys",
        "kaufe kauft kaufen",
        "tr",
        "person",
        "thing vehicle food animal",
        pps=(("for", "person"), ("in", "building area")),
    ),
    _verb(
        "find",
        "finds",
        "finde findet finden",
        "tr",
        "person animal",
        "thing animal person",
        pps=(("in", _PLACES), ("next to", "furniture building")),
    ),
    _verb(
        "eat",
        "eats",
        "esse isst essen",
        "tr",
        "person animal",
        "food",
        pps=(("in", _PLACES), ("with", "person")),
        de_animal=("fresse", "frisst", "fressen"),
    ),
    _verb(
        "carry",
        "carries",
        "trage trägt tragen",
        "tr",
        "person",
        "thing food",
        pps=(("to", "building area"), ("through", "area"), ("for", "person")),
    ),
    _verb(
        "wash",
        "washes",
        "wasche wäscht waschen",
        "tr",
        "person",
        "vehicle animal furniture tool",
        pps=(("in", "room area"), ("for", "person")),
    ),
    _verb(
        "take",
        "takes",
        "nehme nimmt nehmen",
        "tr",
        "person",
        "thing food",
        pps=(("from", "furniture"), ("for", "person")),
    ),
    _verb(
        "visit",
        "visits",
        "besuche besucht besuchen",
        "tr",
        "person",
        "person building area",
        pps=(("with", "person animal"),),
    ),
    _verb(
        "meet",
        "meets",
        "treffe trifft treffen",
        "tr",
        "person",
        "person",
        pps=(("in", "building area"), ("next to", "building")),
    ),
    _verb("love", "loves", "liebe liebt lieben", "tr", "person animal", "person animal"),
    _verb("call", "calls", "rufe ruft rufen", "tr", "person", "person", de_particle="an"),
    _verb(
        "pick",
        "picks",
        "hole holt holen",
        "tr",
        "person",
        "person animal",
        pps=(("from", "building"),),
        en_particle="up",
        de_particle="ab",
    ),
    _verb(
        "open",
        "opens",
        "öffne öffnet öffnen",
        "tr",
        "person",
        "openable",
        pps=(("with", "tool"), ("for", "person")),
    ),
    # ditransitive: dative person + accusative thing ("gives the child an apple")
    _verb("give", "gives", "gebe gibt geben", "ditr", "person", "thing food", "person animal"),
    _verb(
        "show", "shows", "zeige zeigt zeigen", "ditr", "person", "thing animal vehicle", "person"
    ),
    _verb(
        "bring", "brings", "bringe bringt bringen", "ditr", "person", "thing food", "person animal"
    ),
    # intransitive: usually with a prepositional phrase
    _verb(
        "sleep",
        "sleeps",
        "schlafe schläft schlafen",
        "intr",
        "person animal",
        pps=(("in", _PLACES), ("next to", "person furniture building")),
    ),
    _verb(
        "run",
        "runs",
        "laufe läuft laufen",
        "intr",
        "person animal",
        pps=(
            ("to", "person building area"),
            ("through", "area"),
            ("with", "person animal"),
            ("without", "person animal"),
        ),
    ),
    _verb(
        "drive",
        "drives",
        "fahre fährt fahren",
        "intr",
        "person",
        pps=(
            ("to", "building area water"),
            ("through", "area"),
            ("with", "person"),
            ("without", "person animal"),
        ),
    ),
    _verb(
        "work",
        "works",
        "arbeite arbeitet arbeiten",
        "intr",
        "person",
        pps=(("in", _PLACES), ("for", "person"), ("with", "person")),
    ),
    _verb(
        "wait",
        "waits",
        "warte wartet warten",
        "intr",
        "person animal",
        pps=(("for", "person animal vehicle"), ("in", _PLACES), ("next to", "building person")),
        de_preps=(("for", "auf", "acc"),),
    ),
    _verb(
        "play",
        "plays",
        "spiele spielt spielen",
        "intr",
        "person animal",
        pps=(("in", "area room"), ("with", "person animal toy")),
    ),
    _verb(
        "sit",
        "sits",
        "sitze sitzt sitzen",
        "intr",
        "person animal",
        pps=(("on", "furniture"), ("in", _PLACES), ("next to", "person furniture building")),
    ),
    _verb(
        "swim",
        "swims",
        "schwimme schwimmt schwimmen",
        "intr",
        "person animal",
        pps=(("in", "water"), ("through", "water"), ("with", "person animal")),
    ),
    _verb(
        "come",
        "comes",
        "komme kommt kommen",
        "intr",
        "person animal",
        pps=(
            ("from", "building person"),
            ("to", "person building area"),
            ("with", "person animal"),
        ),
    ),
    # copula + predicative adjective (no ending in German: "Der Hund ist klein.")
    _verb("be", "is", "bin ist sind", "cop", "person animal thing vehicle food building room area"),
)

# English preposition -> (German preposition, case). Case is fixed for each one we use;
# "in", "on" and "next to" are two-way prepositions but only used for locations (dative).
PREPOSITIONS: dict[str, tuple[str, str]] = {
    "with": ("mit", "dat"),
    "from": ("von", "dat"),
    "to": ("zu", "dat"),
    "in": ("in", "dat"),
    "on": ("auf", "dat"),
    "next to": ("neben", "dat"),
    "for": ("für", "acc"),
    "without": ("ohne", "acc"),
    "through": ("durch", "acc"),
}
# Preposition + definite article contractions that German requires.
CONTRACTIONS: dict[tuple[str, str], str] = {
    ("zu", "dem"): "zum",
    ("zu", "der"): "zur",
    ("von", "dem"): "vom",
    ("in", "dem"): "im",
}

# English pronoun -> (English object form, German nom, acc, dat, agreement)
PRONOUNS: dict[str, tuple[str, str, str, str, str]] = {
    "I": ("me", "ich", "mich", "mir", "1sg"),
    "he": ("him", "er", "ihn", "ihm", "3sg"),
    "she": ("her", "sie", "sie", "ihr", "3sg"),
    "it": ("it", "es", "es", "ihm", "3sg"),  # only for animals in this corpus
    "we": ("us", "wir", "uns", "uns", "1pl"),
    "they": ("them", "sie", "sie", "ihnen", "3pl"),
}
# Determiners declined like "ein" (ein-words). "no" is only produced by negation (kein).
EIN_WORDS: dict[str, str] = {
    "a": "ein",
    "my": "mein",
    "his": "sein",
    "her": "ihr",
    "our": "unser",
    "their": "ihr",
    "no": "kein",
}
NUMBERS: dict[int, tuple[str, str]] = {
    2: ("two", "zwei"),
    3: ("three", "drei"),
    4: ("four", "vier"),
    5: ("five", "fünf"),
    6: ("six", "sechs"),
    7: ("seven", "sieben"),
    8: ("eight", "acht"),
    9: ("nine", "neun"),
    10: ("ten", "zehn"),
    11: ("eleven", "elf"),
    12: ("twelve", "zwölf"),
}
# Fronted time adverbs trigger verb-second inversion in German ("Heute sieht der Mann ...").
ADVERBS: dict[str, str] = {
    "today": "heute",
    "now": "jetzt",
    "every day": "jeden Tag",
    "in the morning": "am Morgen",
    "in the evening": "am Abend",
    "on Sunday": "am Sonntag",
}
# Subordinating conjunctions: the German verb goes to the end of the clause.
CONJUNCTIONS: dict[str, str] = {
    "because": "weil",
    "while": "während",
    "when": "wenn",
    "although": "obwohl",
}

# ----------------------------------------------------------------------------------------
# German declension tables, indexed [gender or "pl"][case]
# ----------------------------------------------------------------------------------------

_CASES = ("nom", "acc", "dat")


def _table(m: str, f: str, n: str, pl: str) -> dict[str, dict[str, str]]:
    return {g: dict(zip(_CASES, row.split(","))) for g, row in zip("mfn", (m, f, n))} | {
        "pl": dict(zip(_CASES, pl.split(",")))
    }


DEFINITE = _table("der,den,dem", "die,die,der", "das,das,dem", "die,die,den")
EIN_ENDINGS = _table(",en,em", "e,e,er", ",,em", "e,e,en")
# adjective endings: weak after der/die/das, mixed after ein-words, strong with no article
WEAK = _table("e,en,en", "e,e,en", "e,e,en", "en,en,en")
MIXED = _table("er,en,en", "e,e,en", "es,es,en", "en,en,en")
STRONG = _table("er,en,em", "e,e,er", "es,es,em", "e,e,en")

_NOUN_BY_EN = {n.en: n for n in NOUNS}
_ADJ_BY_EN = {a.en: a for a in ADJECTIVES}
_VERB_BY_EN = {v.en: v for v in VERBS}

# ----------------------------------------------------------------------------------------
# Sentence structures (built by the sampler, or by hand in tests) and their realisation
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NP:
    """Noun phrase: a pronoun ("he"; rendered "him"/"ihn" as an object) or a noun (English key)."""

    head: str
    det: str = "the"  # "the", "a", "my", "his", "her", "our", "their", "" (bare plural)
    adj: str | None = None  # English adjective key
    plural: bool = False
    count: int | None = None  # 2..12; implies plural and no article

    @property
    def is_pronoun(self) -> bool:
        return self.head in PRONOUNS

    @property
    def is_plural(self) -> bool:
        return self.plural or self.count is not None

    @property
    def indefinite(self) -> bool:
        """True for "a dog" and bare "dogs": these are negated with German "kein"."""
        return (
            not self.is_pronoun
            and self.count is None
            and (self.det == "a" or (self.det == "" and self.is_plural))
        )


@dataclass(frozen=True)
class PP:
    """Prepositional phrase: English preposition key + noun phrase."""

    prep: str
    np: NP


@dataclass(frozen=True)
class Clause:
    """One clause, independent of word order; the realiser decides main/inverted/verb-final."""

    subj: NP
    verb: str  # English base form key ("pick" for "pick up", "be")
    obj: NP | None = None  # accusative object
    iobj: NP | None = None  # dative object (ditransitive verbs)
    pp: PP | None = None
    adj: str | None = None  # predicative adjective with "be"
    neg: bool = False


@dataclass(frozen=True)
class Sentence:
    """A statement or yes/no question, optionally with a fronted adverb or a subordinate clause."""

    main: Clause
    question: bool = False
    adverb: str | None = None
    conj: str | None = None
    sub: Clause | None = None
    sub_first: bool = False  # "When the dog sleeps, the man reads." (German: inverted main)


def agreement(np: NP) -> str:
    """Person/number of a subject: "1sg", "3sg", "1pl" or "3pl"."""
    if np.is_pronoun:
        return PRONOUNS[np.head][4]
    return "3pl" if np.is_plural else "3sg"


def _en_article(word_after: str) -> str:
    return "an" if word_after[0] in "aeiou" else "a"


def render_np(np: NP, case: str = "nom", negated: bool = False) -> tuple[str, str]:
    """(English, German) for a noun phrase in German case "nom"/"acc"/"dat".

    negated=True turns an indefinite phrase into German "kein" (English stays "a dog"/"dogs")."""
    if case not in _CASES:
        raise ValueError(f"unknown case {case!r}")
    if np.is_pronoun:
        return _render_pronoun(np.head, case)
    noun = _NOUN_BY_EN[np.head]
    adj = _ADJ_BY_EN[np.adj] if np.adj else None
    if np.det == "a" and np.is_plural:
        raise ValueError("'a' with a plural noun")
    return _en_np(np, noun, adj), _de_np(np, noun, adj, case, negated)


def _render_pronoun(head: str, case: str) -> tuple[str, str]:
    """(English, German) for a personal pronoun: "he"/"er", as an object "him"/"ihn"/"ihm"."""
    en_obj, nom, acc, dat, _ = PRONOUNS[head]
    return (head if case == "nom" else en_obj), {"nom": nom, "acc": acc, "dat": dat}[case]


def _en_np(np: NP, noun: Noun, adj: Adjective | None) -> str:
    """English determiner, adjective and noun: "an old dog", "two dogs", "my dogs"."""
    words = [adj.en] if adj else []
    words.append(noun.en_pl if np.is_plural else noun.en)
    if np.count is not None:
        words.insert(0, NUMBERS[np.count][0])
    elif np.det == "a":
        words.insert(0, _en_article(words[0]))
    elif np.det:
        words.insert(0, np.det)
    return " ".join(words)


def _de_np(np: NP, noun: Noun, adj: Adjective | None, case: str, negated: bool) -> str:
    """German determiner, declined adjective and noun: "keinen alten Hund", "den Kindern"."""
    g = "pl" if np.is_plural else noun.gender
    det = "no" if negated and np.indefinite else np.det
    words, endings = _de_determiner(det, np.count, g, case)
    if adj:
        words.append(adj.stem + endings[g][case])
    words.append(_de_noun(noun, np.is_plural, case))
    return " ".join(words)


def _de_determiner(
    det: str, count: int | None, g: str, case: str
) -> tuple[list[str], dict[str, dict[str, str]]]:
    """The German determiner (none for a bare plural) and the adjective endings it calls for:
    weak after der/die/das, mixed after ein-words, strong after a number or no article."""
    if count is not None:
        return [NUMBERS[count][1]], STRONG
    if det == "the":
        return [DEFINITE[g][case]], WEAK
    if det in EIN_WORDS:
        return [EIN_WORDS[det] + EIN_ENDINGS[g][case]], MIXED
    if det == "":
        return [], STRONG
    raise ValueError(f"unknown determiner {det!r}")


def _de_noun(noun: Noun, plural: bool, case: str) -> str:
    """The German noun in its case: dative plurals in -n, weak masculines oblique (den Jungen)."""
    if not plural:
        return noun.de_obl if (noun.de_obl and case != "nom") else noun.de
    if case == "dat" and not noun.de_pl.endswith(("n", "s")):
        return noun.de_pl + "n"  # dative plural: den Kindern, but den Autos
    return noun.de_pl


def render_pp(pp: PP, verb: str | None = None) -> tuple[str, str]:
    """(English, German) for a prepositional phrase, with German contractions (zum, im ...)."""
    de_prep, case = PREPOSITIONS[pp.prep]
    if verb is not None:
        for en_p, de_p, c in _VERB_BY_EN[verb].de_preps:
            if en_p == pp.prep:
                de_prep, case = de_p, c
    en_np, de_np = render_np(pp.np, case)
    first, _, rest = de_np.partition(" ")
    contracted = CONTRACTIONS.get((de_prep, first)) if not pp.np.is_pronoun else None
    de = f"{contracted} {rest}" if contracted else f"{de_prep} {de_np}"
    return f"{pp.prep} {en_np}", de


def conjugate(verb: str, subj: NP) -> tuple[str, str]:
    """Finite present-tense forms (English, German stem part) for a subject: ("sees", "sieht")."""
    v = _VERB_BY_EN[verb]
    agr = agreement(subj)
    if v.kind == "cop":
        en = {"1sg": "am", "3sg": "is"}.get(agr, "are")
    else:
        en = v.en3 if agr == "3sg" else v.en
    forms = v.de
    if v.de_animal and (
        subj.head == "it" or (not subj.is_pronoun and "animal" in _NOUN_BY_EN[subj.head].tags)
    ):
        forms = v.de_animal
    de = forms[0] if agr == "1sg" else forms[1] if agr == "3sg" else forms[2]
    return en, de


def render_clause(clause: Clause, order: str = "main") -> tuple[str, str]:
    """(English, German) for a clause without final punctuation.

    order: "main" (S V O), "inverted" (German V S O after a fronted adverb or clause),
    "question" (English do-support, German V S O) or "sub" (German verb-final)."""
    if order not in ("main", "inverted", "question", "sub"):
        raise ValueError(f"unknown order {order!r}")
    v = _VERB_BY_EN[clause.verb]
    en_fin, de_fin = conjugate(clause.verb, clause.subj)
    en_subj, de_subj = render_np(clause.subj, "nom")
    en = _en_subject_verb(clause, v, order, en_subj, en_fin)
    if v.kind != "cop":
        en += _en_complements(clause, v)
    de = _de_word_order(order, de_subj, de_fin, v.de_particle, _de_middle(clause, v))
    return " ".join(en), " ".join(de)


def _en_subject_verb(clause: Clause, v: Verb, order: str, subj: str, fin: str) -> list[str]:
    """English subject and verb group: "the dog is not old", "does the dog (not) see", "he sees"."""
    neg = ["not"] if clause.neg else []
    if v.kind == "cop":
        head = [fin, subj] if order == "question" else [subj, fin]
        return head + neg + [_ADJ_BY_EN[clause.adj].en]
    if not (clause.neg or order == "question"):
        return [subj, fin]
    # do-support: negation and questions take "do"/"does" and the bare verb
    aux = "does" if agreement(clause.subj) == "3sg" else "do"
    head = [aux, subj] if order == "question" else [subj, aux]
    return head + neg + [v.en]


def _en_complements(clause: Clause, v: Verb) -> list[str]:
    """English words after a full verb: indirect object, object with the particle, PP."""
    words = [render_np(clause.iobj, "dat")[0]] if clause.iobj else []
    words += _en_object(clause.obj, v.en_particle)
    if clause.pp:
        words.append(render_pp(clause.pp, clause.verb)[0])
    return words


def _en_object(obj: NP | None, particle: str) -> list[str]:
    """English object and verb particle: "picks up the ball", but "picks him up"."""
    if not obj:
        return [particle] if particle else []
    en_obj = render_np(obj, "acc")[0]
    if not particle:
        return [en_obj]
    return [en_obj, particle] if obj.is_pronoun else [particle, en_obj]


def _de_middle(clause: Clause, v: Verb) -> list[str]:
    """The German middle field, the same in every word order: objects, negation, PP, adjective."""
    # a negated indefinite object takes "kein" instead of "nicht": "sieht keinen Hund"
    use_kein = clause.neg and clause.obj is not None and clause.obj.indefinite
    middle: list[str] = []
    if clause.iobj:
        middle.append(render_np(clause.iobj, "dat")[1])
    if clause.obj:
        middle.append(render_np(clause.obj, "acc", negated=use_kein)[1])
    if clause.neg and not use_kein:
        middle.append("nicht")
    if clause.pp:
        middle.append(render_pp(clause.pp, clause.verb)[1])
    if v.kind == "cop":
        middle.append(_ADJ_BY_EN[clause.adj].de)
    return middle


def _de_word_order(order: str, subj: str, fin: str, particle: str, middle: list[str]) -> list[str]:
    """German subject and finite verb around the middle field: S V ... (main), V S ... (inverted,
    question) or S ... V (sub, where a separable particle joins the verb)."""
    if order == "sub":
        return [subj] + middle + [particle + fin]  # weil ... anruft
    head = [subj, fin] if order == "main" else [fin, subj]
    return head + middle + ([particle] if particle else [])


def _capitalize(s: str) -> str:
    return s[:1].upper() + s[1:]


def render_sentence(s: Sentence) -> tuple[str, str]:
    """(English, German) for a whole sentence, capitalised and punctuated."""
    if s.question:
        if s.adverb or s.sub:
            raise ValueError("questions have no fronted adverb or subordinate clause")
        en, de = render_clause(s.main, "question")
        return _capitalize(en) + "?", _capitalize(de) + "?"
    if (s.conj is None) != (s.sub is None):
        raise ValueError("conj and sub go together")
    if s.sub_first and s.adverb:
        raise ValueError("a fronted subordinate clause leaves no room for a fronted adverb")
    inverted = bool(s.adverb or s.sub_first)
    en, de = render_clause(s.main, "inverted" if inverted else "main")
    if s.adverb:
        en, de = f"{s.adverb} {en}", f"{ADVERBS[s.adverb]} {de}"
    if s.sub is not None:
        sub_en, sub_de = render_clause(s.sub, "sub")
        conj_de = CONJUNCTIONS[s.conj]
        if s.sub_first:
            en, de = f"{s.conj} {sub_en}, {en}", f"{conj_de} {sub_de}, {de}"
        else:
            en, de = f"{en}, {s.conj} {sub_en}", f"{de}, {conj_de} {sub_de}"
    return _capitalize(en) + ".", _capitalize(de) + "."


# ----------------------------------------------------------------------------------------
# Random sampling of sentences (semantic tags keep them sensible)
# ----------------------------------------------------------------------------------------

_POSSESSIVES = ("my", "his", "her", "our", "their")
_PERSON_PRONOUNS = ("I", "he", "she", "we", "they")


class _Sampler:
    """Draws random `Sentence`s from one random.Random; all choices go through sorted lists."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self._nouns: dict[frozenset[str], list[Noun]] = {}
        self._adjs = {n.en: [a for a in ADJECTIVES if a.tags & n.tags] for n in NOUNS}
        self._verbs = {k: [v for v in VERBS if v.kind == k] for k in ("tr", "ditr", "intr", "cop")}

    def nouns(self, tags: frozenset[str]) -> list[Noun]:
        if tags not in self._nouns:
            self._nouns[tags] = [n for n in NOUNS if n.tags & tags]
        return self._nouns[tags]

    def np(
        self,
        tags: frozenset[str],
        *,
        pronouns: tuple[str, ...] = (),
        pronoun_p: float = 0.0,
        plural_p: float = 0.3,
        adj_p: float = 0.3,
        count_ok: bool = True,
        bare_ok: bool = True,
    ) -> NP:
        r = self.rng
        if pronouns and r.random() < pronoun_p:
            return NP(r.choice(pronouns))
        noun = r.choice(self.nouns(tags))
        adj = r.choice(self._adjs[noun.en]).en if r.random() < adj_p else None
        x = r.random()
        if r.random() < plural_p:
            if count_ok and x < 0.3:
                return NP(noun.en, det="", adj=adj, plural=True, count=r.randint(2, 12))
            det = (
                "the"
                if x < 0.6 or (x < 0.8 and not bare_ok)
                else ""
                if x < 0.8
                else r.choice(_POSSESSIVES)
            )
            return NP(noun.en, det=det, adj=adj, plural=True)
        det = "the" if x < 0.5 else "a" if x < 0.8 else r.choice(_POSSESSIVES)
        return NP(noun.en, det=det, adj=adj)

    def subject(self, v: Verb, no_i: bool = False) -> NP:
        pronouns = _PERSON_PRONOUNS[1:] if no_i else _PERSON_PRONOUNS
        if "animal" in v.subj:
            pronouns += ("it",)
        return self.np(v.subj, pronouns=pronouns, pronoun_p=0.35, adj_p=0.25)

    def obj_pronouns(self, subj: NP) -> tuple[str, ...]:
        # no "I see me" / "we see us": English would need a reflexive
        return tuple(p for p in _PERSON_PRONOUNS if not (p == subj.head and p in ("I", "we")))

    def clause(
        self,
        *,
        inverted: bool = False,
        question: bool = False,
        neg_p: float = 0.0,
        pp_scale: float = 1.0,
        adj_p: float = 0.3,
    ) -> Clause:
        r = self.rng
        kind = r.choices(("tr", "intr", "ditr", "cop"), weights=(42, 30, 13, 15))[0]
        v = r.choice(self._verbs[kind])
        subj = self.subject(v, no_i=question)
        neg = r.random() < neg_p
        # German prefers an object pronoun before a noun subject in inverted clauses; we avoid
        # that case so that word order stays a plain rule.
        pron_ok = not (inverted or question) or subj.is_pronoun
        pron = self.obj_pronouns(subj) if pron_ok else ()
        if kind == "cop":
            tags = (
                frozenset(("person",))
                if subj.head in _PERSON_PRONOUNS
                else (frozenset(("animal",)) if subj.head == "it" else _NOUN_BY_EN[subj.head].tags)
            )
            adj = r.choice([a for a in ADJECTIVES if a.tags & tags]).en
            return Clause(subj, v.en, adj=adj, neg=neg)
        obj = iobj = pp = None
        if kind in ("tr", "ditr"):
            obj = self.np(
                v.obj,
                pronouns=pron if kind == "tr" and "person" in v.obj else (),
                pronoun_p=0.15,
                adj_p=adj_p,
                count_ok=not neg,
            )
        if kind == "ditr":
            iobj = self.np(
                v.iobj,
                pronouns=pron,
                pronoun_p=0.25,
                adj_p=adj_p * 0.5,
                plural_p=0.2,
                bare_ok=False,
            )  # "gives children a book" is stilted
        pp_p = {"tr": 0.35, "intr": 0.85, "ditr": 0.0}[kind] * pp_scale
        if v.pps and r.random() < pp_p:
            prep, tags = r.choice(v.pps)
            pp_pron = self.obj_pronouns(subj) if "person" in tags else ()
            pp = PP(
                prep,
                self.np(tags, pronouns=pp_pron, pronoun_p=0.15, plural_p=0.15, adj_p=adj_p * 0.7),
            )
        return Clause(subj, v.en, obj=obj, iobj=iobj, pp=pp, neg=neg)

    def sentence(self) -> Sentence:
        r = self.rng
        x = r.random()
        if x < 0.12:
            return Sentence(self.clause(question=True), question=True)
        if x < 0.37:
            sub_first = r.random() < 0.3
            main = self.clause(inverted=sub_first, neg_p=0.08, pp_scale=0.4, adj_p=0.15)
            sub = self.clause(neg_p=0.1, pp_scale=0.2 if main.pp else 0.5, adj_p=0.15)
            return Sentence(main, conj=r.choice(tuple(CONJUNCTIONS)), sub=sub, sub_first=sub_first)
        if r.random() < 0.18:
            return Sentence(self.clause(inverted=True, neg_p=0.18), adverb=r.choice(tuple(ADVERBS)))
        return Sentence(self.clause(neg_p=0.18))

    def pair(self) -> tuple[str, str]:
        return render_sentence(self.sentence())


# ----------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------

SPLITS = ("train", "valid", "test")


def generate_pairs(n: int, seed: int) -> list[tuple[str, str]]:
    """n (english, german) pairs, deterministic for a given seed (may contain repeats)."""
    sampler = _Sampler(random.Random(seed))
    return [sampler.pair() for _ in range(n)]


def _count_lines(path: Path) -> int:
    with open(path, "rb") as f:
        return f.read().count(b"\n")


def _write_lines(path: Path, lines: list[str]) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8", newline="\n") as f:
        f.writelines(line + "\n" for line in lines)
    os.replace(tmp, path)


def write_corpus(
    out_dir: str | os.PathLike,
    n_train: int = 24000,
    n_valid: int = 500,
    n_test: int = 1000,
    seed: int = 1234,
) -> dict[str, int]:
    """Write train/valid/test .en/.de files into out_dir; splits are disjoint on the English side.

    Skips the work when all six files already exist with the right line counts."""
    counts = {"train": n_train, "valid": n_valid, "test": n_test}
    if min(counts.values()) < 0:
        raise ValueError(f"split sizes must be >= 0, got {counts}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {(s, lang): out / f"{s}.{lang}" for s in SPLITS for lang in ("en", "de")}
    if all(p.is_file() and _count_lines(p) == counts[s] for (s, _), p in paths.items()):
        return counts

    total = n_train + n_valid + n_test
    rng = random.Random(seed)
    sampler = _Sampler(rng)
    seen: set[str] = set()
    pairs: list[tuple[str, str]] = []
    for _ in range(20 * total + 1000):
        if len(pairs) == total:
            break
        en, de = sampler.pair()
        if en not in seen:
            seen.add(en)
            pairs.append((en, de))
    if len(pairs) < total:
        raise RuntimeError(f"grammar produced only {len(pairs)} distinct sentences, need {total}")
    rng.shuffle(pairs)  # so that every split has the same mix of short and long sentences
    bounds = {
        "train": (0, n_train),
        "valid": (n_train, n_train + n_valid),
        "test": (n_train + n_valid, total),
    }
    for (split, lang), path in paths.items():
        lo, hi = bounds[split]
        _write_lines(path, [p[0 if lang == "en" else 1] for p in pairs[lo:hi]])
    return counts


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    """CLI: python -m transformer_mt.demo_corpus OUT_DIR [--train N] [--valid N] [--test N]
    [--seed S]; prints one summary line to stderr."""
    parser = argparse.ArgumentParser(
        prog="python -m transformer_mt.demo_corpus",
        description="Write the built-in English->German demo corpus (train/valid/test .en/.de).",
    )
    parser.add_argument("out_dir", help="output directory (created if missing)")
    parser.add_argument("--train", type=_non_negative, default=24000, help="training pairs")
    parser.add_argument("--valid", type=_non_negative, default=500, help="validation pairs")
    parser.add_argument("--test", type=_non_negative, default=1000, help="test pairs")
    parser.add_argument("--seed", type=int, default=1234, help="random seed")
    args = parser.parse_args(argv)
    counts = write_corpus(args.out_dir, args.train, args.valid, args.test, args.seed)
    print(
        f"demo corpus: {counts['train']} train, {counts['valid']} valid, {counts['test']} test "
        f"pairs in {args.out_dir} (seed {args.seed})",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
