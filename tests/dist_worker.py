"""One rank of a sharded tiny-model sweep (started by mlx.launch)."""

import sys

from mixbits.measure.distributed import sharded_sweep
from tiny_model import tiny_llama, tiny_tokens

if __name__ == "__main__":
    sharded_sweep(tiny_llama(layers=2), tiny_tokens(n=2), sys.argv[1],
                  ["2b_g64", "4b_g64", "ternary_g64"], progress=False)
