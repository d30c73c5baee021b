"""The real data files the tests read, shipped in tests/data/ so a fresh
clone runs the whole suite: an ExLlamaV2 measurement.json and an
allocation.json (copied from the project's shared data), and config.json,
the Hugging Face config of the model they were measured on."""

import json
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
MEAS = DATA / "measurement.json"
ALLOC = DATA / "allocation.json"
CONFIG = DATA / "config.json"

# The measured model: 48 layers, hidden 4096, 32 heads, 4 KV heads of dim 128, MLP 11008.
HF_CONFIG = json.loads(CONFIG.read_text())
