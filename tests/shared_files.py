"""The real files in ../shared/data (beside the checkout; CI lays shared/
next to the clone) and the shapes of the model the measurement is of."""

from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
MEAS = DATA / "measurement.json"
ALLOC = DATA / "allocation.json"
needs_data = pytest.mark.skipif(
    not (MEAS.exists() and ALLOC.exists()),
    reason=f"shared data files not found in {DATA} (CI places shared/ beside the clone)",
)

# The measured model: 48 layers, hidden 4096, 32 heads, 4 KV heads of dim 128, MLP 11008.
HF_CONFIG = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 4,
             "head_dim": 128, "intermediate_size": 11008, "num_hidden_layers": 48}
