"""The CPU kernels' thread pool (cpp/common/parallel.cpp): every item of
every parallel_for visited exactly once, and no call left waiting.

The pool once lost count when a worker's late claim from a job of few chunks
ran as a chunk of the next, larger job: the caller then waited forever (a CI
run hung). That needs a worker preempted between claiming a chunk and
checking it, so the check oversubscribes the two CPUs (8 and 16 threads) and
runs many tiny jobs of changing sizes back to back. A hang shows as the
subprocess's timeout, so a regression fails instead of stalling the suite.
"""

import os
import subprocess
import sys
import textwrap

import pytest

# Each job j visits [0, SIZES[j % len]); the counts are checked against
# what that schedule implies, computed here without the pool.
SCRIPT = textwrap.dedent(
    """
    import sys, threading
    import mixbits._ext as ext
    sizes, jobs, spin, callers = eval(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    results = [None] * callers
    def call(k):
        results[k] = ext.parallel_for_visits(sizes, 1, jobs, spin)
    threads = [threading.Thread(target=call, args=(k,)) for k in range(callers)]
    for t in threads: t.start()
    for t in threads: t.join()
    print(repr(results))
    """
)


def expected_visits(sizes, jobs):
    most = max(sizes)
    return [sum(1 for j in range(jobs) if sizes[j % len(sizes)] > i) for i in range(most)]


@pytest.mark.parametrize("threads", [2, 8, 16])
@pytest.mark.parametrize(
    "sizes,spin,callers",
    [
        ([2, 64], 0, 1),  # a job of 2 chunks, then one of 8: the old race
        ([1, 3, 64, 5, 200, 2], 0, 1),
        ([2, 64], 100, 1),  # slower items: workers join more often
        ([3, 40, 7], 0, 3),  # three Python threads share the pool; the losers run inline
    ],
)
def test_every_item_once(threads, sizes, spin, callers):
    jobs = 20000
    env = dict(os.environ, MIXBITS_NUM_THREADS=str(threads))
    try:
        out = subprocess.run(
            [sys.executable, "-c", SCRIPT, repr(sizes), str(jobs), str(spin), str(callers)],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,  # a passing run takes well under a second
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"parallel_for hung: {jobs} jobs of sizes {sizes} on {threads} threads")
    assert out.returncode == 0, out.stderr
    results = eval(out.stdout)
    want = expected_visits(sizes, jobs)
    for got in results:
        bad = [(i, g, w) for i, (g, w) in enumerate(zip(got, want)) if g != w]
        assert not bad, f"items visited the wrong number of times (item, got, want): {bad[:5]}"
