"""Tests for the built-in English->German demo corpus (transformer_mt.demo_corpus).

Expected German strings are written by hand from German grammar, not copied from the code."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from transformer_mt import demo_corpus as dc
from transformer_mt.demo_corpus import NP, PP, Clause, Sentence

FILES = ("train.en", "train.de", "valid.en", "valid.de", "test.en", "test.de")


def read_lines(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    assert text.endswith("\n") or text == ""
    return text.split("\n")[:-1]


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    """The default-size corpus, written once for the whole module."""
    out = tmp_path_factory.mktemp("demo") / "nested" / "dir"
    counts = dc.write_corpus(out)
    assert counts == {"train": 24000, "valid": 500, "test": 1000}
    return out


# ---------------------------------------------------------------------------- determinism


def test_same_seed_same_pairs_different_seed_different():
    a = dc.generate_pairs(300, seed=5)
    assert a == dc.generate_pairs(300, seed=5)
    assert len(a) == 300 and all(isinstance(en, str) and isinstance(de, str) for en, de in a)
    b = dc.generate_pairs(300, seed=6)
    assert a != b
    assert len(set(a) & set(b)) < 150  # really a different stream, not a shifted one


def test_generation_ignores_global_random_state():
    random.seed(1)
    a = dc.generate_pairs(50, seed=3)
    random.seed(2)
    random.random()
    assert dc.generate_pairs(50, seed=3) == a


def test_generation_does_not_depend_on_hash_seed():
    """Set iteration order changes with PYTHONHASHSEED; the corpus must not."""
    code = (
        "from transformer_mt.demo_corpus import generate_pairs;print(repr(generate_pairs(200, 11)))"
    )
    outs = []
    for hash_seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=hash_seed)
        root = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        outs.append(
            subprocess.run(
                [sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True
            ).stdout
        )
    assert outs[0] == outs[1] and len(outs[0]) > 1000


# ---------------------------------------------------------------------------- write_corpus


def test_write_corpus_files_counts_and_disjoint_splits(corpus_dir):
    lines = {name: read_lines(corpus_dir / name) for name in FILES}
    assert len(lines["train.en"]) == len(lines["train.de"]) == 24000 >= 20000
    assert len(lines["valid.en"]) == len(lines["valid.de"]) == 500
    assert len(lines["test.en"]) == len(lines["test.de"]) == 1000
    for name, ls in lines.items():
        assert all(line.strip() == line and line for line in ls), name
        assert not any("\r" in line or "\t" in line for line in ls), name
    train, valid, test = (set(lines[f"{s}.en"]) for s in ("train", "valid", "test"))
    assert len(valid) == 500 and len(test) == 1000
    assert not train & valid and not train & test and not valid & test
    # line i of .en and .de belong together: same final punctuation and clause count
    for split in ("train", "valid", "test"):
        for en, de in zip(lines[f"{split}.en"], lines[f"{split}.de"]):
            assert en[-1] == de[-1] and en[-1] in ".?"
            assert en.count(",") == de.count(",")


def test_write_corpus_skips_existing_and_regenerates_broken(tmp_path):
    out = tmp_path / "small"
    assert dc.write_corpus(out, n_train=40, n_valid=5, n_test=7, seed=9) == {
        "train": 40,
        "valid": 5,
        "test": 7,
    }
    assert sorted(p.name for p in out.iterdir()) == sorted(FILES)  # no temp files left
    stamp = {name: (out / name).stat().st_mtime_ns for name in FILES}
    first = (out / "train.de").read_bytes()
    dc.write_corpus(out, n_train=40, n_valid=5, n_test=7, seed=9)
    assert {name: (out / name).stat().st_mtime_ns for name in FILES} == stamp
    (out / "valid.de").write_text("only one line\n", encoding="utf-8")
    dc.write_corpus(out, n_train=40, n_valid=5, n_test=7, seed=9)
    assert len(read_lines(out / "valid.de")) == 5
    assert (out / "train.de").read_bytes() == first  # same seed, same corpus


def test_main_cli(tmp_path, capsys):
    out = tmp_path / "cli"
    assert dc.main([str(out), "--train", "30", "--valid", "4", "--test", "6", "--seed", "2"]) == 0
    assert [len(read_lines(out / n)) for n in FILES] == [30, 30, 4, 4, 6, 6]
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "30" in err
    with pytest.raises(SystemExit):
        dc.main([str(out), "--train", "-1"])


# ---------------------------------------------------------------------------- noun phrases


@pytest.mark.parametrize(
    "np, case, en, de",
    [
        (NP("dog", adj="small"), "acc", "the small dog", "den kleinen Hund"),
        (NP("dog", adj="small"), "nom", "the small dog", "der kleine Hund"),
        (NP("dog", det="a", adj="big"), "acc", "a big dog", "einen großen Hund"),
        (NP("man", det="a", adj="old"), "nom", "an old man", "ein alter Mann"),
        (NP("apple", det="a"), "acc", "an apple", "einen Apfel"),
        (NP("house", det="a", adj="small"), "nom", "a small house", "ein kleines Haus"),
        (NP("car", det="a", adj="expensive"), "acc", "an expensive car", "ein teures Auto"),
        (NP("woman", det="my", adj="young"), "dat", "my young woman", "meiner jungen Frau"),
        (NP("bag", det="our", adj="new"), "acc", "our new bag", "unsere neue Tasche"),
        (NP("dog", adj="small", count=2), "acc", "two small dogs", "zwei kleine Hunde"),
        (NP("dog", adj="small", count=2), "dat", "two small dogs", "zwei kleinen Hunden"),
        (NP("child", count=12), "nom", "twelve children", "zwölf Kinder"),
        (NP("mouse", det="", adj="black", plural=True), "nom", "black mice", "schwarze Mäuse"),
        (
            NP("book", det="", adj="expensive", plural=True),
            "dat",
            "expensive books",
            "teuren Büchern",
        ),
        (NP("child", plural=True), "dat", "the children", "den Kindern"),
        (NP("car", plural=True), "dat", "the cars", "den Autos"),
        (NP("woman", plural=True, adj="tired"), "nom", "the tired women", "die müden Frauen"),
        (NP("boy"), "nom", "the boy", "der Junge"),
        (NP("boy"), "acc", "the boy", "den Jungen"),
        (NP("neighbor", det="his"), "dat", "his neighbor", "seinem Nachbarn"),
        (NP("forest", adj="dark"), "nom", "the dark forest", "der dunkle Wald"),
        (NP("he"), "acc", "him", "ihn"),
        (NP("they"), "dat", "them", "ihnen"),
    ],
)
def test_noun_phrases(np, case, en, de):
    assert dc.render_np(np, case) == (en, de)


def test_negated_indefinite_becomes_kein():
    assert dc.render_np(NP("dog", det="a"), "acc", negated=True)[1] == "keinen Hund"
    assert (
        dc.render_np(NP("apple", det="", plural=True, adj="red"), "acc", negated=True)[1]
        == "keine roten Äpfel"
    )
    assert dc.render_np(NP("dog"), "acc", negated=True)[1] == "den Hund"  # definite: stays


def test_invalid_structures_raise():
    with pytest.raises(ValueError):
        dc.render_np(NP("dog", det="a", plural=True))
    with pytest.raises(ValueError):
        dc.render_np(NP("dog"), "gen")
    with pytest.raises(ValueError):
        dc.render_clause(Clause(NP("he"), "sleep"), order="sideways")


@pytest.mark.parametrize(
    "pp, en, de",
    [
        (PP("with", NP("woman", adj="old")), "with the old woman", "mit der alten Frau"),
        (PP("with", NP("friend", det="a")), "with a friend", "mit einem Freund"),
        (PP("with", NP("he")), "with him", "mit ihm"),
        (PP("to", NP("station")), "to the station", "zum Bahnhof"),
        (PP("to", NP("school", adj="new")), "to the new school", "zur neuen Schule"),
        (PP("from", NP("office")), "from the office", "vom Büro"),
        (PP("in", NP("garden")), "in the garden", "im Garten"),
        (PP("in", NP("kitchen")), "in the kitchen", "in der Küche"),
        (PP("next to", NP("house")), "next to the house", "neben dem Haus"),
        (PP("for", NP("man", adj="old")), "for the old man", "für den alten Mann"),
        (PP("without", NP("dog", det="their")), "without their dog", "ohne ihren Hund"),
        (PP("through", NP("forest")), "through the forest", "durch den Wald"),
        (PP("on", NP("chair")), "on the chair", "auf dem Stuhl"),
    ],
)
def test_prepositional_phrases(pp, en, de):
    assert dc.render_pp(pp) == (en, de)


# ---------------------------------------------------------------------------- sentences

S = Sentence
C = Clause


@pytest.mark.parametrize(
    "sentence, en, de",
    [
        (S(C(NP("he"), "see", obj=NP("dog"))), "He sees the dog.", "Er sieht den Hund."),
        (S(C(NP("we"), "see", obj=NP("dog"))), "We see the dog.", "Wir sehen den Hund."),
        (S(C(NP("I"), "read", obj=NP("book", det="a"))), "I read a book.", "Ich lese ein Buch."),
        (
            S(C(NP("she"), "read", obj=NP("book", det="a"))),
            "She reads a book.",
            "Sie liest ein Buch.",
        ),
        (
            S(C(NP("man"), "drive", pp=PP("to", NP("city")))),
            "The man drives to the city.",
            "Der Mann fährt zur Stadt.",
        ),
        (
            S(C(NP("child", plural=True), "play", pp=PP("in", NP("garden"))), adverb="today"),
            "Today the children play in the garden.",
            "Heute spielen die Kinder im Garten.",
        ),
        (
            S(C(NP("woman"), "give", obj=NP("apple", det="a"), iobj=NP("child"))),
            "The woman gives the child an apple.",
            "Die Frau gibt dem Kind einen Apfel.",
        ),
        (
            S(C(NP("she"), "wait", pp=PP("for", NP("bus")))),
            "She waits for the bus.",
            "Sie wartet auf den Bus.",
        ),
        (
            S(C(NP("dog", plural=True), "be", adj="hungry")),
            "The dogs are hungry.",
            "Die Hunde sind hungrig.",
        ),
        (S(C(NP("I"), "be", adj="tired", neg=True)), "I am not tired.", "Ich bin nicht müde."),
        (
            S(C(NP("dog"), "eat", obj=NP("sausage"))),
            "The dog eats the sausage.",
            "Der Hund frisst die Wurst.",
        ),
        (
            S(C(NP("boy"), "eat", obj=NP("sausage"))),
            "The boy eats the sausage.",
            "Der Junge isst die Wurst.",
        ),
        # negation: nicht after a definite object, kein for an indefinite one
        (
            S(C(NP("man"), "see", obj=NP("dog"), neg=True)),
            "The man does not see the dog.",
            "Der Mann sieht den Hund nicht.",
        ),
        (
            S(C(NP("man"), "see", obj=NP("dog", det="a"), neg=True)),
            "The man does not see a dog.",
            "Der Mann sieht keinen Hund.",
        ),
        (
            S(C(NP("they"), "eat", obj=NP("apple", det="", plural=True), neg=True)),
            "They do not eat apples.",
            "Sie essen keine Äpfel.",
        ),
        (
            S(C(NP("child"), "sleep", pp=PP("in", NP("house")), neg=True)),
            "The child does not sleep in the house.",
            "Das Kind schläft nicht im Haus.",
        ),
        # separable verbs: particle at the end of a main clause
        (
            S(C(NP("woman"), "call", obj=NP("doctor"))),
            "The woman calls the doctor.",
            "Die Frau ruft den Arzt an.",
        ),
        (
            S(C(NP("mother"), "pick", obj=NP("he"))),
            "The mother picks him up.",
            "Die Mutter holt ihn ab.",
        ),
        (
            S(C(NP("mother"), "pick", obj=NP("child"), pp=PP("from", NP("school")))),
            "The mother picks up the child from the school.",
            "Die Mutter holt das Kind von der Schule ab.",
        ),
        # yes/no questions: German verb first
        (
            S(C(NP("girl"), "see", obj=NP("cat")), question=True),
            "Does the girl see the cat?",
            "Sieht das Mädchen die Katze?",
        ),
        (
            S(C(NP("they"), "call", obj=NP("teacher")), question=True),
            "Do they call the teacher?",
            "Rufen sie den Lehrer an?",
        ),
        (
            S(C(NP("bird", det="my"), "be", adj="small"), question=True),
            "Is my bird small?",
            "Ist mein Vogel klein?",
        ),
        # subordinate clauses: German verb last
        (
            S(
                C(NP("woman"), "read", obj=NP("book", det="a")),
                conj="because",
                sub=C(NP("man"), "see", obj=NP("dog")),
            ),
            "The woman reads a book, because the man sees the dog.",
            "Die Frau liest ein Buch, weil der Mann den Hund sieht.",
        ),
        (
            S(C(NP("I"), "work"), conj="while", sub=C(NP("woman"), "call", obj=NP("doctor"))),
            "I work, while the woman calls the doctor.",
            "Ich arbeite, während die Frau den Arzt anruft.",
        ),
        (
            S(
                C(NP("he"), "sleep"),
                conj="although",
                sub=C(NP("she"), "wait", pp=PP("for", NP("bear")), neg=True),
            ),
            "He sleeps, although she does not wait for the bear.",
            "Er schläft, obwohl sie nicht auf den Bären wartet.",
        ),
        (
            S(
                C(NP("man"), "read", obj=NP("newspaper")),
                conj="when",
                sub=C(NP("dog"), "sleep"),
                sub_first=True,
            ),
            "When the dog sleeps, the man reads the newspaper.",
            "Wenn der Hund schläft, liest der Mann die Zeitung.",
        ),
        (
            S(
                C(NP("we"), "be", adj="hungry"),
                conj="because",
                sub=C(NP("child", plural=True), "be", adj="tired"),
            ),
            "We are hungry, because the children are tired.",
            "Wir sind hungrig, weil die Kinder müde sind.",
        ),
    ],
)
def test_sentences(sentence, en, de):
    assert dc.render_sentence(sentence) == (en, de)


def test_verb_agreement_all_persons():
    expected = {
        "I": ("I see", "ich sehe"),
        "he": ("he sees", "er sieht"),
        "she": ("she sees", "sie sieht"),
        "it": ("it sees", "es sieht"),
        "we": ("we see", "wir sehen"),
        "they": ("they see", "sie sehen"),
    }
    for pron, (en, de) in expected.items():
        got_en, got_de = dc.render_clause(Clause(NP(pron), "see", obj=NP("dog")))
        assert got_en == en + " the dog" and got_de == de + " den Hund"
    assert dc.conjugate("drive", NP("man")) == ("drives", "fährt")
    assert dc.conjugate("take", NP("I")) == ("take", "nehme")
    assert dc.conjugate("take", NP("woman")) == ("takes", "nimmt")
    assert dc.conjugate("be", NP("horse", count=3)) == ("are", "sind")


# ---------------------------------------------------------------------------- corpus-wide


def _types(lines) -> set[str]:
    return {w.strip(".,?") for line in lines for w in line.split()}


def test_vocabulary_is_demo_sized(corpus_dir):
    de = _types(read_lines(corpus_dir / "train.de"))
    en = _types(read_lines(corpus_dir / "train.en"))
    assert 250 <= len(de) <= 1500
    assert 150 <= len(en) <= 1500


def test_lexicon_sizes_and_german_nouns_capitalised():
    assert 40 <= len(dc.NOUNS) <= 65
    assert 15 <= len(dc.ADJECTIVES) <= 25
    assert 15 <= len(dc.VERBS) <= 30
    for n in dc.NOUNS:
        assert n.de[0].isupper() and n.de_pl[0].isupper(), n


def test_corpus_wide_grammar_invariants(corpus_dir):
    en_lines = read_lines(corpus_dir / "train.en")
    de_lines = read_lines(corpus_dir / "train.de")
    lowercase = "[a-zäöüß]+"
    noun = "[A-ZÄÖÜ]"
    lengths = []
    numbers = (
        "two three four five six seven eight nine ten eleven twelve".split(),
        "zwei drei vier fünf sechs sieben acht neun zehn elf zwölf".split(),
    )
    finals = {}
    for en, de in zip(en_lines, de_lines):
        lengths.append(len(en.split()))
        assert en[0].isupper() and de[0].isupper()
        assert (en[-1] == "?") == (de[-1] == "?")
        if en.endswith("?"):
            assert en.split()[0] in ("Do", "Does", "Is", "Are", "Am")
        # contractions are obligatory in German
        assert not re.search(r"\b(zu dem|zu der|von dem|in dem)\b", de), de
        # adjective endings: weak after das/dem/den, mixed after ein-words without ending
        for m in re.finditer(rf"\bdas ({lowercase}) {noun}", de):
            assert m.group(1).endswith("e") and not m.group(1).endswith("en"), de
        for m in re.finditer(rf"\b(dem|den) ({lowercase}) {noun}", de):
            assert m.group(2).endswith("en"), de
        for m in re.finditer(rf"\b(ein|kein|mein|sein|unser) ({lowercase}) {noun}", de):
            assert m.group(2).endswith(("er", "es")), de
        # numbers translate one to one
        for e, g in zip(*numbers):
            assert en.split().count(e) == de.split().count(g), (en, de)
        # subordinate clauses end in a finite verb (lowercase, not a particle or pronoun)
        for m in re.finditer(
            r"(?:^|, )(?:weil|während|wenn|obwohl) ([^,]*?)[.,]", de, flags=re.IGNORECASE
        ):
            last = m.group(1).split()[-1]
            finals[last] = finals.get(last, 0) + 1
            assert last[0].islower() and last not in {
                "nicht",
                "an",
                "ab",
                "ihn",
                "sie",
                "ihm",
                "ihr",
                "ihnen",
                "uns",
                "mich",
                "mir",
                "es",
            }, de
            assert re.search(r"(t|e|n|bin|sind)$", last), de
    assert 4 <= sum(lengths) / len(lengths) <= 14
    assert max(lengths) <= 25 and min(lengths) >= 2
    assert "anruft" in finals or "abholt" in finals  # separable verbs do occur verb-final
