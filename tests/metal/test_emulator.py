"""The SIMT emulator's own tests: correct kernels give the right answers in
every thread order, and deliberately wrong kernels (missing barrier,
divergent simd ops, a barrier skipped by some threads) fail."""

import re

import numpy as np
import pytest

import metal_emu as E

ORDERS = ["forward", "reverse", "shuffle"]


@pytest.fixture(scope="module", autouse=True)
def emulator():
    if E.compiler() is None:
        pytest.skip("no C++ compiler to build the Metal emulator")
    E.lib()


def data(groups, threads, seed=0):
    return np.random.default_rng(seed).standard_normal(groups * threads).astype(np.float32)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("threads", [32, 48, 96, 256, 1024])
def test_group_sum(threads, order):
    groups = 3
    x = data(groups, threads)
    got = E.selftest("st_group_sum", x, groups, threads, groups, order=order)
    want = x.reshape(groups, threads).astype(np.float64).sum(axis=1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("order", ORDERS)
def test_threadgroup_memory_shared_within_and_separate_across_groups(order):
    groups, threads = 4, 128
    x = data(groups, threads, seed=1)
    got = E.selftest("st_reverse", x, groups, threads, groups * threads, order=order)
    np.testing.assert_array_equal(got, x.reshape(groups, threads)[:, ::-1].ravel())


@pytest.mark.parametrize("order", ORDERS)
def test_missing_barrier_gives_wrong_result(order):
    # The same exchange as st_reverse without its barrier: in every order some
    # thread reads its mirror's slot before the mirror wrote it.
    groups, threads = 2, 128
    x = data(groups, threads, seed=2)
    got = E.selftest("st_reverse_no_barrier", x, groups, threads, groups * threads, order=order)
    want = x.reshape(groups, threads)[:, ::-1].ravel()
    wrong = ~(got == want)
    assert wrong.sum() >= threads // 2, f"only {wrong.sum()} wrong outputs"


@pytest.mark.parametrize("threads", [32, 64, 40])
def test_shuffles_match_lane_arithmetic(threads):
    groups = 2
    x = np.arange(groups * threads, dtype=np.float32) * 1.5 - 7
    got = E.selftest("st_shuffles", x, groups, threads, groups * threads * 6).reshape(-1, 6)
    for t in range(groups * threads):
        base = (t // threads) * threads + ((t % threads) // 32) * 32
        n = min(32, (t // threads + 1) * threads - base)  # lanes of this simdgroup
        lane = t - base
        sg = x[base:base + n]
        down = sg[lane + 3] if lane + 3 < n else x[t]
        xor = sg[lane ^ 5] if (lane ^ 5) < n else x[t]
        up = sg[lane - 2] if lane >= 2 else x[t]
        want = [down, xor, sg[7], sg.max(), up, sg.min()]
        np.testing.assert_array_equal(got[t], want, err_msg=f"thread {t}")


def test_divergent_simd_sum_fails():
    with pytest.raises(E.EmulatorError, match=r"simd_sum at selftest.metal:\d+ reached by only "
                                             r"16 of 32 lanes"):
        E.selftest("st_divergent_sum", data(1, 64), 1, 64, 64)


def test_simd_ops_at_different_sites_fail():
    with pytest.raises(E.EmulatorError, match="meet at different simd ops"):
        E.selftest("st_split_sum", data(1, 32), 1, 32, 32)


def test_barrier_skipped_by_some_threads_fails():
    with pytest.raises(E.EmulatorError, match=r"threadgroup_barrier at selftest.metal:\d+ "
                                             r"reached by 32 of 128 threads"):
        E.selftest("st_early_return", data(1, 128), 1, 128, 128)


def test_threads_at_different_barriers_fail():
    with pytest.raises(E.EmulatorError, match="wait at different barriers"):
        E.selftest("st_barrier_mismatch", data(1, 64), 1, 64, 64)


def test_shuffle_from_missing_lane_fails():
    with pytest.raises(E.EmulatorError, match="reads lane 40"):
        E.selftest("st_bad_lane", data(1, 32), 1, 32, 32)


def test_out_of_bounds_write_is_reported_not_fatal():
    with pytest.raises(E.EmulatorError, match="out of bounds"):
        E.selftest("st_write_past_end", data(2, 64), 2, 64, 128)
    # The emulator is usable again afterwards.
    x = data(1, 64)
    np.testing.assert_array_equal(E.selftest("st_reverse", x, 1, 64, 64), x[::-1])


def test_unknown_kernel_name_fails():
    with pytest.raises(E.EmulatorError, match="no kernel instantiated"):
        E.selftest("st_nope", data(1, 32), 1, 32, 32)


def test_every_instantiation_registered():
    # qmatmul: the kernels that walk a segment table (qmv, qmm, qmm16,
    # gather_qmv, gather_qmm, qmv_t, gather_qmv_t) per 3 activation types x
    # 3 scale types (widths and group sizes come from the table); the
    # gathered transposed product's grouping (1); kl: 3 x 3 (reference,
    # logits) types; selftest: 19 kernels; fp_qmv: 3 modes x 3 activation
    # types. Duplicate host names would collapse into one entry.
    assert E.kernel_count() == 3 * 3 * 7 + 1 + 3 * 3 + 19 + 3 * 3


METAL_SOURCES = sorted(E.METAL_DIR.glob("*.metal")) + sorted(E.EMU_DIR.glob("*.metal"))


@pytest.mark.parametrize("src", METAL_SOURCES, ids=lambda p: p.name)
def test_no_function_local_threadgroup_arrays(src):
    # The emulator shares threadgroup memory only through [[threadgroup(i)]]
    # parameters; a local `threadgroup T x[n];` would silently be per-thread.
    text = src.read_text()
    bad = re.findall(r"^\s*threadgroup\s+[\w:<>]+\s+\w+\s*\[", text, flags=re.M)
    assert not bad, bad


def kernel_buffer_indices(text: str) -> dict[str, list[int]]:
    out = {}
    for m in re.finditer(r"\[\[kernel\]\]\s+void\s+(\w+)\s*\((.*?)\)\s*\{", text, flags=re.S):
        out[m.group(1)] = [int(i) for i in re.findall(r"\[\[buffer\((\d+)\)\]\]", m.group(2))]
    return out


def enum_values(text: str, enum: str) -> list[int]:
    body = re.search(r"enum\s+" + enum + r"\s*\{(.*?)\};", text, flags=re.S).group(1)
    return [int(v) for v in re.findall(r"=\s*(\d+)\s*,", body)]


@pytest.mark.parametrize("metal,params,enum,n", [
    ("qmatmul_gemv.metal", "qmatmul_params.h", "MbQmmBuffer", 29),
    ("qmatmul_tiled.metal", "qmatmul_params.h", "MbQmmBuffer", 29),
    ("gather_qmv.metal", "gather_params.h", "MbGatherQmvBuffer", 31),
    ("gather_qmm.metal", "gather_params.h", "MbGatherQmvBuffer", 31),
    ("qmatmul_t.metal", "qmatmul_t_params.h", "MbQmvTBuffer", 28),
    ("kl.metal", "kl_params.h", "MbKlBuffer", 10),
])
def test_buffer_indices_follow_declaration_order(metal, params, enum, n):
    # The harness binds buffers by position and the Mac host by the enum in
    # the params header: both agree with [[buffer(i)]] only if the i-th
    # buffer parameter has index i and the enum numbers them 0..n-1.
    kernels = kernel_buffer_indices((E.METAL_DIR / metal).read_text())
    assert kernels
    for name, idx in kernels.items():
        assert idx == list(range(n)), (name, idx)
    assert enum_values((E.METAL_DIR / params).read_text(), enum) == list(range(n))


@pytest.mark.parametrize("metal,params,enum,prefix,n", [
    ("gather_qmv_t.metal", "gather_t_params.h", "MbGatherTBuffer", "MB_GT_", 2),
])
def test_transposed_kernels_buffer_indices_follow_the_enum_by_name(metal, params, enum,
                                                                   prefix, n):
    # The gathered transposed product's two kernels bind subsets of one
    # buffer numbering (MbGatherTBuffer), so declaration order cannot be the
    # rule there: each buffer parameter's index must be the enum value of
    # its name (dy -> MB_GT_DY, wq0 -> MB_GT_WQ0, gp -> MB_GT_PARAMS), which
    # is what the host plan and the harness bind by.
    text = (E.METAL_DIR / metal).read_text()
    header = (E.METAL_DIR / params).read_text()
    body = re.search(r"enum\s+" + enum + r"\s*\{(.*?)\};", header, flags=re.S).group(1)
    values = {k: int(v) for k, v in re.findall(r"(" + prefix + r"\w+)\s*=\s*(\d+)", body)}
    kernels = re.findall(r"\[\[kernel\]\]\s+void\s+(\w+)\s*\((.*?)\)\s*\{", text, flags=re.S)
    assert len(kernels) == n
    for name, args in kernels:
        bound = re.findall(r"(\w+)\s*\[\[buffer\((\d+)\)\]\]", args)
        assert bound, name
        for arg, idx in bound:
            key = prefix + ("PARAMS" if arg in ("p", "gp") else arg.upper())
            assert values.get(key) == int(idx), (name, arg, idx, key)


# Metal: the thread position / size attributes declared as vectors must all
# have the same number of components (MSL spec, "Attributes for kernel
# function input arguments"); uint3 next to a scalar uint fails to compile.
# thread_index_in_threadgroup and the simdgroup attributes are scalars by
# definition and not part of this rule.
VECTOR_ATTRS = ("thread_position_in_grid", "thread_position_in_threadgroup",
                "threadgroup_position_in_grid", "threads_per_grid",
                "threads_per_threadgroup", "threadgroups_per_grid",
                "dispatch_threads_per_threadgroup", "grid_origin", "grid_size")


def position_attr_widths(text: str) -> dict[str, dict[str, int]]:
    text = re.sub(r"\\\n", " ", text)  # macros spanning lines (selftest's ST_ARGS)
    macros = dict(re.findall(r"#define\s+(\w+)\s+(.*)", text))
    out = {}
    for m in re.finditer(r"\[\[kernel\]\]\s+void\s+(\w+)\s*\((.*?)\)\s*\{", text, flags=re.S):
        params = m.group(2)
        for name, body in macros.items():
            params = re.sub(rf"\b{name}\b", body, params)
        widths = {}
        for ty, attr in re.findall(r"\b(u?(?:int|short)[234]?)\s+\w+\s*\[\[(\w+)\]\]", params):
            if attr in VECTOR_ATTRS:
                widths[attr] = int(ty[-1]) if ty[-1].isdigit() else 1
        out[m.group(1)] = widths
    return out


@pytest.mark.parametrize("src", METAL_SOURCES, ids=lambda p: p.name)
def test_position_attributes_agree_in_vector_width(src):
    kernels = position_attr_widths(src.read_text())
    assert kernels
    for name, widths in kernels.items():
        assert len(set(widths.values())) <= 1, (name, widths)


def test_position_attribute_rule_catches_a_mix():
    bad = ("[[kernel]] void k(uint3 tid [[threadgroup_position_in_grid]],\n"
           "  uint n [[threads_per_threadgroup]], uint l [[thread_index_in_threadgroup]]) {}")
    assert position_attr_widths(bad) == {"k": {"threadgroup_position_in_grid": 3,
                                               "threads_per_threadgroup": 1}}


# ---------------------------------------------------------------- simdgroup matrices

def sgmm_want(x):
    """st_sgmm's four products from the 8 x 16 matrix [L | R], in float64."""
    T = x.reshape(8, 16).astype(np.float64)
    L, R = T[:, :8], T[:, 8:]
    return [L @ R + 1, R.T @ L + 2 * np.eye(8), (L @ L + R).T, R @ R + L]


def check_sgmm_regions(got, want):
    got = got.reshape(4, 8, 16)
    for s in range(4):
        assert np.isnan(got[s, :, :8]).all(), f"simdgroup {s} wrote left of its origin"
        np.testing.assert_allclose(got[s, :, 8:], want[s], rtol=1e-5, atol=1e-5,
                                   err_msg=f"simdgroup {s}")


@pytest.mark.parametrize("order", ORDERS)
def test_simdgroup_matrix_load_store_mma(order):
    # Origins, transposed load and store, diagonal / filled constructors,
    # a loaded accumulator: each against numpy.
    x = data(1, 128, seed=3)
    got = E.selftest("st_sgmm", x, 1, 128, 512, order=order)
    check_sgmm_regions(got, sgmm_want(x))


@pytest.mark.parametrize("order", ORDERS)
def test_simdgroup_matrix_wrong_origin_gives_wrong_result(order):
    x = data(1, 128, seed=4)
    got = E.selftest("st_sgmm_wrong_origin", x, 1, 128, 512, order=order).reshape(4, 8, 16)
    want = sgmm_want(x)[0]
    for s in range(4):
        assert not np.allclose(got[s, :, 8:], want, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("order", ORDERS)
def test_simdgroup_matrix_load_without_barrier_gives_wrong_result(order):
    # The emulator runs a simdgroup on as soon as its lanes meet at a simd
    # op, so its loads see threadgroup memory other simdgroups have not yet
    # written (NaN), in every thread order.
    x = data(1, 128, seed=5)
    got = E.selftest("st_sgmm_no_barrier", x, 1, 128, 512, order=order).reshape(4, 8, 16)
    want = sgmm_want(x)[0]
    wrong = [not np.allclose(got[s, :, 8:], want, rtol=1e-5, atol=1e-5) for s in range(4)]
    assert any(wrong), "a load without a barrier read every element in time"


@pytest.mark.parametrize("order", ORDERS)
def test_simdgroup_store_needs_a_barrier_before_other_lanes_read(order):
    x = data(1, 64, seed=6)
    ok = E.selftest("st_sgmm_store_barrier", x, 1, 64, 64, order=order)
    np.testing.assert_array_equal(ok, x[::-1])
    bad = E.selftest("st_sgmm_store_no_barrier", x, 1, 64, 64, order=order)
    assert (bad != x[::-1]).any()


def test_divergent_simdgroup_load_fails():
    # Lanes 16..31 skip the load and meet the others at the store instead.
    with pytest.raises(E.EmulatorError, match=r"meet at different simd ops: lane 0 at "
                                             r"simdgroup_load selftest.metal:\d+, lane 16 at "
                                             r"simdgroup_store"):
        E.selftest("st_sgmm_divergent", data(1, 64), 1, 64, 64)


def test_simdgroup_load_with_lane_dependent_arguments_fails():
    with pytest.raises(E.EmulatorError, match="lanes pass different arguments to simdgroup_load"):
        E.selftest("st_sgmm_lane_args", data(1, 128), 1, 128, 64)
