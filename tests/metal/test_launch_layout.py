"""The dense quantized matmul's launch plan (metal/qmatmul_host.h, which
cpp/qmatmul/metal.cpp binds on a Mac and the emulator harness binds here)
against the kernels' own parameter lists (qmatmul_gemv.metal,
qmatmul_tiled.metal): every [[buffer(i)]] has a plan entry at index i of the
same name, direction and element type, the parameter block sits where the
kernel declares it, and the segment table carries each segment's width,
group and column range. Plain C++ (plan_dump.cpp) and text: no Metal, no
emulator build; what only a Mac can check is that Apple's compiler accepts
the kernels (tests/metal/check_on_mac.sh)."""

import json
import re
import subprocess

import pytest

import metal_emu as E

KERNELS = ("qmatmul_gemv.metal", "qmatmul_tiled.metal")
ELEM = {"float32": 0, "float16": 1, "bfloat16": 2}


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    cxx = E.compiler()
    if cxx is None:
        pytest.skip("no C++ compiler")
    exe = tmp_path_factory.mktemp("plan") / "plan_dump"
    r = subprocess.run([cxx, "-std=c++17", "-Wall", "-Werror", f"-I{E.METAL_DIR}",
                        str(E.EMU_DIR / "plan_dump.cpp"), "-o", str(exe)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr

    def plan(M, N, perm, xt, st, path, segs):
        args = [str(v) for v in (M, N, int(perm), ELEM[xt], ELEM[st], path)]
        args += [str(v) for s in segs for v in s]
        out = subprocess.run([str(exe), *args], capture_output=True, text=True, check=True)
        return [json.loads(line) for line in out.stdout.splitlines()]
    return plan


def kernel_params(metal: str) -> list[tuple[int, str, bool, str]]:
    """(index, name, is_output, element) of each buffer parameter of the one
    kernel in `metal`; element is the declared pointee: uint32_t, int32_t,
    float, IO (x / out storage), SC (scale storage) or the params struct."""
    text = (E.METAL_DIR / metal).read_text()
    kernels = re.findall(r"\[\[kernel\]\]\s+void\s+\w+\s*\((.*?)\)\s*\{", text, flags=re.S)
    assert len(kernels) == 1
    out = []
    for decl, idx in re.findall(r"([^,]*?)\s*\[\[buffer\((\d+)\)\]\]", kernels[0]):
        decl = " ".join(decl.split())
        name = re.search(r"(\w+)$", decl).group(1)
        is_out = not decl.startswith(("const ", "constant "))
        if "IO::storage" in decl:
            elem = "IO"
        elif "SC::storage" in decl:
            elem = "SC"
        else:
            elem = re.search(r"(?:device|constant)\s+(\w+)", decl).group(1)
        out.append((int(idx), name, is_out, elem))
    return out


# path: 0 auto, 1 GEMV, 2 tiled (M 5 and 3 pick GEMV, 17 the tiled kernel).
CASES = [
    (3, 10, True, "float16", "bfloat16", 1, [(4, 64, 128), (2, 32, 64)]),
    (3, 10, True, "float16", "bfloat16", 2, [(4, 64, 128), (2, 32, 64)]),
    (17, 40, False, "bfloat16", "float32", 0, [(8, 128, 256)]),
    (5, 9, True, "float32", "float16", 0, [(b, 32, 32) for b in (8, 6, 5, 4, 3, 2, 2, 2, 3, 4)]),
    (17, 9, False, "float32", "float16", 0, [(b, 32, 32) for b in (8, 6, 5, 4, 3, 2, 2, 2, 3)]),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"M{c[0]}-path{c[5]}-segs{len(c[6])}")
def test_plan_binds_what_the_kernel_declares(dump, case):
    M, N, perm, xt, st, path, segs = case
    launches = dump(M, N, perm, xt, st, path, segs)
    tiled = path == 2 or (path == 0 and M > 8)
    assert all(bool(l["tiled"]) == tiled for l in launches)
    params = kernel_params(KERNELS[int(tiled)])
    want_elem = {"IO": xt, "SC": st, "uint32_t": "uint32", "int32_t": "int32",
                 "float": "float32"}
    for l in launches:
        kind = "qmv" if not tiled else "qmm16" if M <= 16 else "qmm"
        assert l["kernel"] == f"mixbits_{kind}_{xt}_{st}"
        by_index = {b["index"]: b for b in l["buffers"]}
        assert sorted(by_index) == list(range(len(l["buffers"])))
        assert len(params) == len(l["buffers"]) + 1  # + the parameter block
        for idx, name, is_out, elem in params:
            if elem == "MbQmmFusedParams":
                assert idx == l["params_index"] and not is_out
                continue
            b = by_index[idx]
            assert re.sub(r"\d+$", "", name.replace("acc_buf", "acc")) == b["name"], (idx, name)
            assert bool(b["out"]) == is_out, (idx, name)
            assert b["elem"] == want_elem[elem], (idx, name, b["elem"])
            if b["count"] == 0:  # unused: bound to a freshly allocated output
                assert by_index[b["stand_in"]]["out"] and by_index[b["stand_in"]]["count"]
        # Segment j of this launch: slots in the order of the kernel's wqj,
        # scalesj, biasesj, sized from its own segment.
        first = l["first_segment"]
        k0 = sum(s[2] for s in segs[:first])
        for j in range(8):
            named = {n: b for (i, n, _, _), b in ((p, by_index.get(p[0])) for p in params)
                     if b is not None and n.endswith(str(j)) and not n.startswith("acc")}
            assert set(named) == {f"wq{j}", f"scales{j}", f"biases{j}"}
            if j < l["nseg"]:
                bits, gs, k = segs[first + j]
                assert l["seg"][j] == [bits, gs.bit_length() - 1, k0, k]
                assert named[f"wq{j}"]["count"] == N * k * bits // 32
                assert named[f"scales{j}"]["count"] == named[f"biases{j}"]["count"] == N * k // gs
                k0 += k
            else:
                assert all(b["count"] == 0 for b in named.values())
    assert k0 == sum(s[2] for s in segs)
    assert launches[-1]["write_out"] == 1 and launches[0]["accumulate"] == 0


def test_more_segments_than_slots_split_with_a_partial_sum(dump):
    segs = [(4, 32, 32)] * 11
    ls = dump(3, 8, False, "float32", "float32", 0, segs)
    assert [(l["first_segment"], l["nseg"], l["accumulate"], l["write_out"]) for l in ls] == \
        [(0, 8, 0, 0), (8, 3, 1, 1)]
    for l in ls:
        acc = next(b for b in l["buffers"] if b["name"] == "acc")
        assert acc["count"] == 3 * 8 and acc["elem"] == "float32"
    one = dump(3, 8, False, "float32", "float32", 0, segs[:8])
    assert len(one) == 1 and next(b for b in one[0]["buffers"] if b["name"] == "acc")["count"] == 0


def test_eval_gpu_binds_segments_by_the_plans_slots():
    # cpp/qmatmul/metal.cpp cannot run here; its binding loop must use the
    # plan's slot functions and segment offset (what the harness does), not
    # slot numbers of its own.
    text = (E.ROOT / "cpp" / "qmatmul" / "metal.cpp").read_text()
    body = text[text.index("void MixedQMatmul::eval_gpu"):text.index("void MixedQMatmulT::")]
    for needle in ("host::qmm_wq_slot(j)", "host::qmm_scales_slot(j)", "host::qmm_biases_slot(j)",
                   "l.first_segment + j", "j < l.params.nseg", "arrays[MB_QMM_X]",
                   "arrays[MB_QMM_PERM]", "arrays[MB_QMM_ACC]", "arrays[MB_QMM_OUT]"):
        assert needle in body, needle
    assert not re.search(r"arrays\[\s*\d", body)


@pytest.mark.parametrize("M,perm,xt,sets,groups", [
    (1, False, "float16", 1, 32), (1, True, "float16", 2, 16), (2, False, "float16", 1, 32),
    (4, False, "float16", 2, 16), (5, False, "float16", 4, 8), (8, False, "float16", 4, 8),
    (8, True, "float16", 4, 8), (8, False, "float32", 4, 8), (9, False, "float16", 1, 0)])
def test_gemv_lane_sets_bound_x_rereads(dump, M, perm, xt, sets, groups):
    # qmv_shape at 4096 x 4096, 4-bit group 64 (two segments): the core-count
    # choice (32 simdgroups, 128 rows, 32 threadgroups) while the
    # threadgroups' x (and perm) reads stay within 1/16 of W's bytes, else
    # 2 or 4 lane sets per simdgroup (256, 512 rows); the tiled kernel
    # (M = 9) is given 1, which it ignores.
    (l,) = dump(M, 4096, perm, xt, "float16", 0, [(4, 64, 2048), (4, 64, 2048)])
    assert l["qmv_sets"] == sets
    if groups:
        assert l["group"][0] == 32 * 32 and l["grid"][0] == groups
        rows = 4096 // groups
        w_bytes = 4096 * (4096 // 2 + 2 * 64 * 2)
        x_bytes = M * 4096 * (4 if xt == "float32" else 2) + (4 * 4096 if perm else 0)
        # at most 1/16 of W unless the threadgroup is already at 512 rows
        assert groups * x_bytes <= w_bytes / 16 or rows == 512
        assert rows == 128 or (rows // 2) * w_bytes / 4096 < 16 * x_bytes


@pytest.mark.parametrize("M,xt,st,tg_bytes", [
    (12, "float16", "float16", 13056), (17, "float16", "float16", 10496),
    (12, "float16", "float32", 21248), (17, "float16", "float32", 14592),
    (12, "bfloat16", "bfloat16", 21248), (17, "float32", "float16", 18688)])
def test_tiled_threadgroup_memory_per_dtype(dump, M, xt, st, tg_bytes):
    # Two buffers of an x tile (x as stored, rows of 32 + 16 / bytes) and a
    # W tile (float16 rows of 40 when x and the scales are float16, else
    # float rows of 36), then two steps' 32 perm entries: 10.3 / 12.8 KiB
    # (32- / 16-row blocks) with float16 x and scales, was 14.3 / 20.8 KiB.
    (l,) = dump(M, 64, False, xt, st, 0, [(4, 64, 128)])
    bm = 16 if M <= 16 else 32
    xb = 4 if xt == "float32" else 2
    wb = 2 if xt == st == "float16" else 4
    tile = lambda rows, b: rows * (32 + 16 // b) * b  # noqa: E731
    assert l["threadgroup_bytes"] == tg_bytes == \
        2 * (tile(bm, xb) + tile(32 * 32 // bm, wb)) + 2 * 32 * 4
