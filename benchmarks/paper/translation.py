"""A translation-style few-shot prompt prefix (English to German), as in the paper's shared-prefix
experiment (Figure 17: WMT16 En-De with 1-shot and 5-shot prefixes). The example pairs are our own."""

from __future__ import annotations

INSTRUCTION = "Translate English to German.\n\n"

EXAMPLES = [
    ("The committee will publish its final report on the new railway line at the end of next month, after "
     "hearing the objections of the residents.",
     "Der Ausschuss wird seinen Abschlussbericht zur neuen Bahnstrecke Ende nächsten Monats veröffentlichen, "
     "nachdem er die Einwände der Anwohner angehört hat."),
    ("Although the weather was cold and windy, thousands of people gathered in the square to watch the concert.",
     "Obwohl das Wetter kalt und windig war, versammelten sich Tausende Menschen auf dem Platz, um das Konzert "
     "zu sehen."),
    ("My grandmother still writes letters by hand because she says that emails feel too impersonal.",
     "Meine Großmutter schreibt immer noch Briefe von Hand, weil sie sagt, dass sich E-Mails zu unpersönlich "
     "anfühlen."),
    ("The company expects its profits to rise by twelve percent this year, mainly thanks to exports to Asia.",
     "Das Unternehmen erwartet, dass seine Gewinne in diesem Jahr um zwölf Prozent steigen, vor allem dank der "
     "Exporte nach Asien."),
    ("Please make sure that all windows are closed and the lights are switched off before you leave the "
     "building.",
     "Bitte stellen Sie sicher, dass alle Fenster geschlossen und die Lichter ausgeschaltet sind, bevor Sie "
     "das Gebäude verlassen."),
]


def few_shot_prefix(shots: int) -> str:
    """The instruction followed by `shots` example pairs (1 to 5)."""
    if not 1 <= shots <= len(EXAMPLES):
        raise ValueError(f"shots must be between 1 and {len(EXAMPLES)}, got {shots}")
    pairs = "".join(f"English: {en}\nGerman: {de}\n\n" for en, de in EXAMPLES[:shots])
    return INSTRUCTION + pairs
