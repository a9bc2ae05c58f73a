"""What the session fixture ``scraped_server`` (tests/conftest.py) sends and expects."""

SCRAPED_PROMPTS = ["The capital of France is", "Mountain goats can climb", "The old lighthouse keeper climbed the stairs"]
SCRAPED_LAYERS = {"0", "10", "19", "29"}  # ATTN_OTEL_LAYERS=auto on SmolLM2's 30 layers
