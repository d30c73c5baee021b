"""Run a tiny-model sweep in its own process (killed by test_sweep_kill)."""

import sys

from mixbits.measure.sweep import sweep
from tiny_model import tiny_llama, tiny_tokens

if __name__ == "__main__":
    out, resume = sys.argv[1], sys.argv[2] == "resume"
    sweep(tiny_llama(layers=4), tiny_tokens(n=4, t=32), out,
          ["2b_g64", "3b_g64", "4b_g64", "8b_g64", "ternary_g64"],
          resume=resume, progress=False, max_batch=4)
