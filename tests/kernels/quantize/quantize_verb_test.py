"""End-to-end test of `meshproof quantize`: writes an HDF5 input, runs the real binary, and
re-derives the expected bytes independently in numpy from docs/design.md section 4 (an fp8 value
table built from the format definition, nearest-value rounding with ties to the even code,
saturation; scale rules via exact float64 / numpy float32 IEEE arithmetic). Also checks that bad
input exits 2 with a message naming it and leaves no output behind.

usage: quantize_verb_test.py MESHPROOF_BINARY WORK_DIR
"""
import os
import subprocess
import sys

import h5py
import numpy as np

BIN, WORK = sys.argv[1], sys.argv[2]
os.makedirs(WORK, exist_ok=True)
F32 = np.float32


def fp8_table(e5m2):
    """Magnitudes of all finite codes, by code."""
    mbits, bias = (2, 15) if e5m2 else (3, 7)
    n_finite = 0x7C if e5m2 else 0x7F
    vals = []
    for c in range(n_finite):
        e, m = c >> mbits, c & ((1 << mbits) - 1)
        vals.append(m * 2.0 ** (1 - bias - mbits) if e == 0 else (1 + m / 2 ** mbits) * 2.0 ** (e - bias))
    return np.array(vals, dtype=np.float64)


def encode(x32, e5m2):
    """Round-to-nearest-even, saturating cast of float32 values to fp8 codes (uint8)."""
    table = fp8_table(e5m2)
    x = x32.astype(np.float64)
    sign = np.where(np.signbit(x), 0x80, 0).astype(np.uint8)
    a = np.minimum(np.abs(np.nan_to_num(x, nan=0.0)), table[-1])
    hi = np.clip(np.searchsorted(table, a, side="left"), 0, len(table) - 1)
    lo = np.maximum(hi - 1, 0)
    dlo, dhi = a - table[lo], table[hi] - a
    pick_lo = (dlo < dhi) | ((dlo == dhi) & (lo % 2 == 0))
    code = np.where(table[hi] == a, hi, np.where(pick_lo, lo, hi)).astype(np.uint8)
    code = code | sign
    return np.where(np.isnan(x), sign | 0x7F, code).astype(np.uint8)


def decode(q, e5m2):
    table = fp8_table(e5m2)
    mag = (q & 0x7F).astype(np.int64)
    nan = mag >= len(table)
    v = table[np.minimum(mag, len(table) - 1)]
    v = np.where(nan, np.nan, v)
    return np.where(q & 0x80, -v, v)


def run(*args):
    return subprocess.run([BIN, "quantize", *args], capture_output=True, text=True)


def write_input(path, x, name="/x"):
    with h5py.File(path, "w") as f:
        f.create_dataset(name, data=x)


failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what)


rng = np.random.default_rng(7)


def make_x(M, K):
    x = rng.normal(0, 3, size=(M, K)).astype(F32)
    x[0, :] = 0
    x[1, 3] = 1e4  # outlier
    x[2, :] *= F32(1e-30)
    x[3, 5] = -np.inf
    return x


# ---- current scaling -------------------------------------------------------------------------
for fmt, e5m2, fmax in (("e4m3", False, 448.0), ("e5m2", True, 57344.0)):
    M, K = 48, 80
    x = make_x(M, K)
    x[3, 5] = 7.0  # finite for current scaling (an inf amax gives scale 1; covered in C++ tests)
    inp, out = f"{WORK}/cur_in.h5", f"{WORK}/cur_{fmt}.h5"
    write_input(inp, x)
    r = run("--recipe", "current", "--format", fmt, "--backend", "cpu", "--in", inp, "--out", out)
    check(r.returncode == 0, f"current {fmt} exit {r.returncode}: {r.stderr}")
    with h5py.File(out, "r") as f:
        amax = F32(np.max(np.abs(x)))
        scale = F32(fmax) / amax  # numpy float32 division is IEEE correctly rounded
        q = encode((x * scale).astype(F32), e5m2)
        check(f["/amax"][0] == amax, f"current {fmt} amax")
        check(np.array_equal(f["/rowwise/data"][()], q), f"current {fmt} rowwise bytes")
        check(np.array_equal(f["/columnwise/data"][()], q), f"current {fmt} columnwise bytes")
        check(f["/rowwise/scale_inv"][0] == F32(1) / scale, f"current {fmt} scale_inv")
        deq = (decode(q, e5m2).astype(F32) * (F32(1) / scale)).astype(F32)
        check(np.array_equal(f["/rowwise/dequantized"][()], deq), f"current {fmt} dequantized")
        check(f.attrs["recipe"] == "current" and f.attrs["format"] == fmt
              and f.attrs["backend"] == "cpu", f"current {fmt} attributes")

# ---- delayed (given scale) with a non-default dataset -------------------------------------------
x = make_x(33, 70)
# Exact ties after scaling by 0.5: 17 (16|18 -> 16), 19 (18|20 -> 20), 2^-10 (0|2^-9 -> 0),
# 3*2^-10 (2^-9|2^-8 -> 2^-8), 464 (448|480 -> 448 and saturated anyway).
x[4, :6] = np.array([34, 38, -34, 2.0**-9, 3 * 2.0**-9, 928], dtype=F32)
inp, out = f"{WORK}/del_in.h5", f"{WORK}/del.h5"
write_input(inp, x, "/acts/fc1")
r = run("--recipe", "delayed", "--scale", "0.5", "--backend", "cpu", "--in", inp + ":/acts/fc1",
        "--out", out)
check(r.returncode == 0, f"delayed exit {r.returncode}: {r.stderr}")
with h5py.File(out, "r") as f:
    q = encode((x * F32(0.5)).astype(F32), False)
    check(np.array_equal(f["/rowwise/data"][()], q), "delayed rowwise bytes (inf saturates)")
    check(np.array_equal(f["/columnwise/data"][()], q), "delayed columnwise bytes")
    check(f["/rowwise/scale_inv"][0] == 2.0, "delayed scale_inv")
    check(list(f["/rowwise/data"][4, :6]) == [0x58, 0x5A, 0xD8, 0x00, 0x02, 0x7E], "delayed ties")


# ---- mxfp8 -------------------------------------------------------------------------------------
def e8m0_round_up(v):
    """Smallest e with 2^(e-127) >= v, clamped to [0, 254]; exact via frexp (v = f * 2^p)."""
    f, p = np.frexp(v.astype(np.float64))
    e = np.where(f == 0.5, p - 1, p) + 127
    e = np.clip(e, 0, 254)
    return np.where(v == 0, 0, e).astype(np.int64)


M, K = 64, 96
x = make_x(M, K)
x[3, 5] = 2.5
inp, out = f"{WORK}/mx_in.h5", f"{WORK}/mx.h5"
write_input(inp, x)
r = run("--recipe", "mxfp8", "--backend", "cpu", "--in", inp, "--out", out)
check(r.returncode == 0, f"mxfp8 exit {r.returncode}: {r.stderr}")
inv_max = F32(1.0 / 448.0)
with h5py.File(out, "r") as f:
    # rowwise 1x32
    blocks = np.abs(x).reshape(M, K // 32, 32).max(axis=2)
    e = e8m0_round_up((blocks * inv_max).astype(F32))
    mult = np.repeat(np.ldexp(1.0, 127 - e), 32, axis=1).astype(F32)
    q = encode((x * mult).astype(F32), False)
    check(np.array_equal(f["/rowwise/scale_inv"][()], e.astype(np.uint8)), "mxfp8 rowwise scales")
    check(np.array_equal(f["/rowwise/data"][()], q), "mxfp8 rowwise bytes")
    deq = (decode(q, False) * np.repeat(np.ldexp(1.0, e - 127), 32, axis=1)).astype(F32)
    check(np.array_equal(f["/rowwise/dequantized"][()], deq), "mxfp8 dequantized")
    # columnwise 32x1
    cblocks = np.abs(x).reshape(M // 32, 32, K).max(axis=1)
    ce = e8m0_round_up((cblocks * inv_max).astype(F32))
    cmult = np.repeat(np.ldexp(1.0, 127 - ce), 32, axis=0).astype(F32)
    cq = encode((x * cmult).astype(F32), False)
    check(np.array_equal(f["/columnwise/scale_inv"][()], ce.astype(np.uint8)), "mxfp8 col scales")
    check(np.array_equal(f["/columnwise/data"][()], cq), "mxfp8 columnwise bytes")

# ---- block 1x128 (partial blocks) --------------------------------------------------------------
M, K = 5, 200
x = make_x(M, K)
x[3, 5] = 1.0
inp, out = f"{WORK}/blk_in.h5", f"{WORK}/blk.h5"
write_input(inp, x)
r = run("--recipe", "block", "--block", "1x128", "--backend", "cpu", "--in", inp, "--out", out)
check(r.returncode == 0, f"block exit {r.returncode}: {r.stderr}")
with h5py.File(out, "r") as f:
    sinv = np.zeros((M, 2), dtype=F32)
    q = np.zeros((M, K), dtype=np.uint8)
    for m in range(M):
        for j, (k0, k1) in enumerate(((0, 128), (128, 200))):
            amax = F32(np.max(np.abs(x[m, k0:k1])))
            s = F32(1.0) if amax == 0 else F32(2.0 ** np.floor(np.log2(np.float64(F32(448.0) / amax))))
            sinv[m, j] = F32(1) / s
            q[m, k0:k1] = encode((x[m, k0:k1] * s).astype(F32), False)
    check(np.array_equal(f["/rowwise/scale_inv"][()], sinv), "block rowwise scales")
    check(np.array_equal(f["/rowwise/data"][()], q), "block rowwise bytes")
    check(f["/columnwise/scale_inv"].shape == (1, K), "block columnwise scale layout [ceil(M/128), K]")


def current_scale(amax, fmax, pow2):
    """docs/design.md section 4 current scale in float32: fmax / amax (IEEE float32 division),
    amax 0/inf/NaN -> 1, an infinite quotient -> FLT_MAX, pow2 -> the largest power of two <= that
    (frexp, exact)."""
    amax = F32(amax)
    if not (amax > 0) or np.isinf(amax):
        return F32(1)
    s = F32(fmax) / amax
    if np.isinf(s):
        s = np.finfo(F32).max
    if pow2:
        s = F32(np.ldexp(1.0, int(np.frexp(np.float64(s))[1]) - 1))
    return s


# ---- current scaling with power-of-two scales --------------------------------------------------
M, K = 40, 72
x = make_x(M, K)
x[3, 5] = 7.0
inp, out = f"{WORK}/p2_in.h5", f"{WORK}/p2.h5"
write_input(inp, x)
r = run("--recipe", "current", "--pow2-scales", "--backend", "cpu", "--in", inp, "--out", out)
check(r.returncode == 0, f"current --pow2-scales exit {r.returncode}: {r.stderr}")
with h5py.File(out, "r") as f:
    amax = F32(np.max(np.abs(x)))
    scale = current_scale(amax, 448.0, True)
    # amax 1e4 (the outlier): 448/1e4 = 0.0448 -> 2^-5
    check(scale == F32(2.0**-5), f"pow2 scale {scale} (want 2^-5 for amax 1e4)")
    q = encode((x * scale).astype(F32), False)
    check(f["/amax"][0] == amax, "current --pow2-scales amax")
    check(f["/rowwise/scale_inv"][0] == F32(1) / scale, "current --pow2-scales scale_inv")
    check(np.array_equal(f["/rowwise/data"][()], q), "current --pow2-scales rowwise bytes")
    check(np.array_equal(f["/columnwise/data"][()], q), "current --pow2-scales columnwise bytes")
    deq = (decode(q, False).astype(F32) * (F32(1) / scale)).astype(F32)
    check(np.array_equal(f["/rowwise/dequantized"][()], deq), "current --pow2-scales dequantized")

# ---- block 1x128 with fp32 scales and an amax floor (--no-pow2-scales --eps) -------------------
# TE semantics: amax clamped below by eps, then scale = fp8_max / amax, not rounded.
M, K = 4, 128
x = make_x(M, K)
x[2, :] = F32(1e-6)  # a tiny block: eps decides its scale
inp, out = f"{WORK}/b32_in.h5", f"{WORK}/b32.h5"
write_input(inp, x)
r = run("--recipe", "block", "--no-pow2-scales", "--eps", "0.01", "--backend", "cpu", "--in", inp,
        "--out", out)
check(r.returncode == 0, f"block --no-pow2-scales --eps exit {r.returncode}: {r.stderr}")
with h5py.File(out, "r") as f:
    sinv = np.zeros((M, 1), dtype=F32)
    q = np.zeros((M, K), dtype=np.uint8)
    for m in range(M):
        amax = max(F32(np.max(np.abs(x[m]))), F32(0.01))
        s = F32(1) if np.isinf(amax) else F32(448.0) / F32(amax)
        sinv[m, 0] = F32(1) / s
        q[m] = encode((x[m] * s).astype(F32), False)
    check(sinv[2, 0] == F32(1) / (F32(448.0) / F32(0.01)), "the tiny block's scale is 448 / eps")
    check(np.array_equal(f["/rowwise/scale_inv"][()], sinv), "block fp32 scales with eps")
    check(np.array_equal(f["/rowwise/data"][()], q), "block fp32 scales rowwise bytes")
    check(f.attrs["pow2_scales"] == "0" and f.attrs["eps"] == "0.01", "block scale attributes")

# ---- block 128x128, e5m2 (partial tiles in both dims; one tile holds -inf -> scale 1) ---------
M, K = 200, 136
x = make_x(M, K)  # keeps x[3, 5] = -inf: its tile's amax is inf, so its scale is 1
inp, out = f"{WORK}/tile_in.h5", f"{WORK}/tile.h5"
write_input(inp, x)
r = run("--recipe", "block", "--block", "128x128", "--format", "e5m2", "--backend", "cpu",
        "--in", inp, "--out", out)
check(r.returncode == 0, f"block 128x128 exit {r.returncode}: {r.stderr}")
with h5py.File(out, "r") as f:
    mb, kb = (M + 127) // 128, (K + 127) // 128
    sinv = np.zeros((mb, kb), dtype=F32)
    q = np.zeros((M, K), dtype=np.uint8)
    deq = np.zeros((M, K), dtype=F32)
    for i in range(mb):
        for j in range(kb):
            tile = np.s_[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            s = current_scale(np.max(np.abs(x[tile])), 57344.0, True)
            sinv[i, j] = F32(1) / s
            q[tile] = encode((x[tile] * s).astype(F32), True)
            deq[tile] = (decode(q[tile], True) * np.float64(sinv[i, j])).astype(F32)
    check(sinv[0, 0] == 1, "the tile holding -inf has scale 1")
    check(q[3, 5] == 0xFB, "-inf saturates to -57344 (0xFB)")
    check(f["/rowwise/scale_inv"].shape == (mb, kb), "block 128x128 scale layout [ceil(M/128), ceil(K/128)]")
    check(np.array_equal(f["/rowwise/scale_inv"][()], sinv), "block 128x128 rowwise scales")
    check(np.array_equal(f["/rowwise/data"][()], q), "block 128x128 rowwise bytes")
    # One scale per tile serves both copies: the columnwise copy (in input positions) is the same.
    check(np.array_equal(f["/columnwise/scale_inv"][()], sinv), "block 128x128 columnwise scales")
    check(np.array_equal(f["/columnwise/data"][()], q), "block 128x128 columnwise bytes")
    check(np.array_equal(f["/rowwise/dequantized"][()], deq), "block 128x128 dequantized")
    check(f.attrs["recipe"] == "block" and f.attrs["format"] == "e5m2", "block 128x128 attributes")

# ---- bad input: exit 2, message names it, no output left ---------------------------------------
def expect_bad(args, needle, what):
    out = f"{WORK}/bad_out.h5"
    if os.path.exists(out):
        os.remove(out)
    r = run(*args, "--out", out)
    check(r.returncode == 2, f"{what}: exit {r.returncode} (want 2): {r.stderr}")
    check(needle in r.stderr, f"{what}: stderr does not name '{needle}': {r.stderr}")
    check(not os.path.exists(out), f"{what}: output file was written")
    leftovers = [n for n in os.listdir(WORK) if ".tmp." in n]
    check(not leftovers, f"{what}: temp files left: {leftovers}")


expect_bad(["--recipe", "current", "--in", f"{WORK}/missing.h5"], "missing.h5", "missing file")
write_input(f"{WORK}/ok.h5", np.ones((32, 32), dtype=F32))
expect_bad(["--recipe", "current", "--in", f"{WORK}/ok.h5:/nope"], "/nope", "missing dataset")
write_input(f"{WORK}/r3.h5", np.ones((2, 32, 32), dtype=F32))
expect_bad(["--recipe", "current", "--in", f"{WORK}/r3.h5"], "rank 3", "3-D dataset")
write_input(f"{WORK}/f64.h5", np.ones((32, 32), dtype=np.float64))
expect_bad(["--recipe", "current", "--in", f"{WORK}/f64.h5"], "not float32", "float64 dataset")
write_input(f"{WORK}/odd.h5", np.ones((33, 64), dtype=F32))
expect_bad(["--recipe", "mxfp8", "--in", f"{WORK}/odd.h5"], "[33, 64]", "mxfp8 shape")
expect_bad(["--recipe", "fp4", "--in", f"{WORK}/ok.h5"], "--recipe", "unknown recipe")
expect_bad(["--recipe", "mxfp8", "--eps", "0.1", "--in", f"{WORK}/ok.h5"], "--eps",
           "--eps with mxfp8")
expect_bad(["--recipe", "current", "--eps", "2", "--in", f"{WORK}/ok.h5"], "--eps 2",
           "--eps out of range")
expect_bad(["--recipe", "block", "--pow2-scales", "--no-pow2-scales", "--in", f"{WORK}/ok.h5"],
           "contradict", "both pow2 flags")
with open(f"{WORK}/notes.h5", "w") as fh:
    fh.write("not hdf5")
expect_bad(["--recipe", "current", "--in", f"{WORK}/notes.h5"], "notes.h5", "not an HDF5 file")

# ---- CUDA backend: identical bytes to the CPU backend (only where a device is usable) ----------
import json  # noqa: E402

env = json.loads(subprocess.run([BIN, "env", "--json"], capture_output=True, text=True).stdout)
if env["cuda"]["usable"]:
    x = make_x(96, 160)
    write_input(f"{WORK}/dev_in.h5", x)
    for recipe in (["current"], ["current", "--pow2-scales"], ["current", "--eps", "0.5"],
                   ["delayed", "--scale", "3"], ["mxfp8"], ["block"],
                   ["block", "--no-pow2-scales", "--eps", "0.5"],
                   ["block", "--block", "128x128", "--format", "e5m2"]):
        outs = {}
        for backend in ("cpu", "cuda"):
            outs[backend] = f"{WORK}/dev_{backend}.h5"
            r = run("--recipe", *recipe, "--backend", backend, "--in", f"{WORK}/dev_in.h5",
                    "--out", outs[backend])
            check(r.returncode == 0, f"{recipe} {backend}: exit {r.returncode}: {r.stderr}")
        with h5py.File(outs["cpu"], "r") as a, h5py.File(outs["cuda"], "r") as b:
            names = []
            a.visit(lambda n: names.append(n) if isinstance(a[n], h5py.Dataset) else None)
            for n in names:
                check(a[n][()].tobytes() == b[n][()].tobytes(), f"{recipe}: {n} differs cpu/cuda")
else:
    print("CUDA not usable; cpu/cuda byte comparison skipped:", env["cuda"]["unusable_reason"])
    expect_bad(["--recipe", "current", "--backend", "cuda", "--in", f"{WORK}/ok.h5"], "cuda",
               "cuda backend without a device")

if failures:
    print(f"{len(failures)} check(s) failed")
    sys.exit(1)
print("all quantize verb checks passed")
