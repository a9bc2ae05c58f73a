"""Deterministic natural-language prompts of a wanted length (in SmolLM2 tokens, roughly)."""

SENTENCES = [
    "The old lighthouse keeper climbed the spiral stairs every evening to light the lamp.",
    "Ships passing the rocky coast relied on its beam to find the harbour in the fog.",
    "One winter night a storm knocked out the power across the whole island.",
    "He lit the backup oil lantern and kept it burning until the sun rose over the sea.",
    "The fishermen later thanked him with a basket of fresh bread and smoked fish.",
    "Scientists measure the temperature of the ocean to understand how currents move heat.",
    "A recipe for tomato soup needs ripe tomatoes, onions, garlic, olive oil and basil.",
    "The committee postponed its decision on the new bridge until the spring meeting.",
    "Mountain goats can climb nearly vertical cliffs thanks to their split hooves.",
    "In the library, a student found a letter hidden between the pages of an atlas.",
]


def prose(n_words: int, seed: int = 0) -> str:
    words: list[str] = []
    i = seed
    while len(words) < n_words:
        words.extend(SENTENCES[i % len(SENTENCES)].split())
        i += 3 + seed % 4
    return " ".join(words[:n_words])
