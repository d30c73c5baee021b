"""Fuzz test (fixed seed, bounded time): random shapes, dtypes, bits, group
sizes, permutations and invalid arguments through quantize / qmatmul /
quantized_matmul / kl_divergence / MixedQuantizedLinear, and random
corruptions of measurement.json, allocation.json, sensitivity tables,
config.json and safetensors files. The cases run in a subprocess
(tests/fuzz_worker.py), so a segfault fails this test, not the run."""

import json
import subprocess
import sys
from pathlib import Path

SEED, SECONDS, MAX_CASES = 17, 150, 1200


def test_fuzz_no_crash_no_wrong_answer(capsys):
    worker = Path(__file__).with_name("fuzz_worker.py")
    p = subprocess.run([sys.executable, str(worker), str(SEED), str(SECONDS), str(MAX_CASES)],
                       capture_output=True, text=True, timeout=SECONDS + 120)
    assert p.returncode == 0, f"fuzz worker died (rc {p.returncode}: a crash if negative)\n{p.stderr[-3000:]}"
    result = json.loads(p.stdout.strip().splitlines()[-1])
    total = sum(result["cases"].values())
    with capsys.disabled():
        print(f"\nfuzz: {total} cases {result['cases']}, {result['n_failures']} failures, 0 crashes")
    assert result["n_failures"] == 0, json.dumps(result["failures"], indent=1)
    assert total >= 600, f"only {total} cases ran in {SECONDS} s"
