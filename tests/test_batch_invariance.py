"""A sentence's translation must not depend on what else is in its batch: mixed batches against
one sentence at a time, on the bundled pair, in lossless and top-β mode. The sentences differ in
length so that batches are padded, and several make the small model run to its length limit,
which SequenceGenerator would take from the batch's longest source."""

import pytest

from spec_nmt.translator import SpecTranslator
from tests.conftest import BUNDLED_MODEL_DIR

SENTENCES = [
    "Ja.",
    "Danke schön!",
    "Der Zug kommt heute später an.",
    "Wir haben gestern lange über die Zukunft der Stadt gesprochen, aber niemand wusste eine Antwort.",
    "Die Kommission legte am Mittwoch einen Bericht vor.",
    "Warum?",
    "Im Sommer fahren viele Familien mit dem Auto an die Nordsee, weil die Bahn zu teuer ist.",
    "Das Spiel endete unentschieden.",
    "Nach Angaben der Polizei wurde bei dem Unfall auf der Autobahn niemand schwer verletzt, "
    "doch die Strecke blieb bis zum Abend gesperrt.",
    "Sie lacht.",
    "Die Preise für Strom und Gas sind im vergangenen Jahr deutlich gestiegen.",
    "Ich weiß es nicht.",
    "Der Minister sagte, die Verhandlungen würden in der nächsten Woche fortgesetzt.",
    "Hunde bellen, Katzen schweigen.",
    "Eine Mehrheit der Abgeordneten stimmte für den Antrag der Opposition, der eine unabhängige "
    "Untersuchung der Vorwürfe gegen die Regierung fordert.",
    "Morgen regnet es.",
]


@pytest.fixture(scope="module")
def translator():
    return SpecTranslator.from_pretrained(BUNDLED_MODEL_DIR, device="cpu")


@pytest.mark.parametrize(
    "settings",
    [
        {"beta": 1, "tau": 0.0, "block_size": 6, "max_draft_batch": 0},
        {"beta": 3, "tau": 1.0, "block_size": 6},
        {"beta": 5, "tau": 3.0, "block_size": 10},
        # rows stop at different levels: a stopped row's later slots must count for nothing
        {"beta": 3, "tau": 1.0, "block_size": 8, "draft_stop": 0.6, "max_draft_batch": 0},
    ],
    ids=["lossless", "top3-tau1", "top5-tau3-k10", "top3-tau1-stop"],
)
def test_mixed_batches_translate_like_one_sentence_at_a_time(translator, settings):
    alone = [translator.translate(line, **settings) for line in SENTENCES]
    for batch_size in (4, 16):
        assert translator.translate(SENTENCES, batch_size=batch_size, **settings) == alone
    # the same sentences in another order, so that each meets other neighbours
    reordered = SENTENCES[::2] + SENTENCES[1::2]
    expected = alone[::2] + alone[1::2]
    assert translator.translate(reordered, batch_size=5, **settings) == expected
