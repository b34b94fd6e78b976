"""`meshproof quantize --recipe nvfp4` against an independent numpy implementation of the NVFP4
numerics contract (docs/design.md section 25), byte for byte: 1x16 blocks, 16x16 tiles (--2d) and
the random Hadamard transform (--rht) on random, outlier, tiny and tie inputs. The E2M1 and E4M3
casts are nearest-value searches in value tables built from the format definitions (ties to the
even code), the scale rules numpy float32 IEEE arithmetic in the contract's order, and the RHT a
float64 loop in index order. Also: bad shapes and option clashes exit 2 naming them, with no
output left behind; the CUDA backend gives the CPU's bytes where a device is usable.

usage: nvfp4_verb_test.py MESHPROOF_BINARY WORK_DIR
"""
import json
import os
import subprocess
import sys

import h5py
import numpy as np

BIN, WORK = sys.argv[1], sys.argv[2]
os.makedirs(WORK, exist_ok=True)
F32 = np.float32
FLT_MAX = F32(np.finfo(np.float32).max)
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
# E4M3 finite magnitudes by code (bias 7, 3 mantissa bits, code 0x7F is NaN).
E4M3 = np.array([(c & 7) * 2.0 ** -9 if c >> 3 == 0 else (1 + (c & 7) / 8) * 2.0 ** ((c >> 3) - 7)
                 for c in range(0x7F)])
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what)


def nearest_code(a, table):
    """Index of the nearest table value to a >= 0 (float64), ties to the even index; saturates."""
    a = np.minimum(a, table[-1])
    hi = np.clip(np.searchsorted(table, a, side="left"), 0, len(table) - 1)
    lo = np.maximum(hi - 1, 0)
    dlo, dhi = a - table[lo], table[hi] - a
    pick_lo = (dlo < dhi) | ((dlo == dhi) & (lo % 2 == 0))
    return np.where(table[hi] == a, hi, np.where(pick_lo, lo, hi)).astype(np.uint8)


def e2m1(v):
    """Codes of clamped float32 values: code 8 for every v < 0, none for +-0."""
    return nearest_code(np.abs(v.astype(np.float64)), E2M1) | np.where(v < 0, 8, 0).astype(np.uint8)


def e4m3(v):
    return nearest_code(v.astype(np.float64), E4M3)  # v >= 0 here


def quantize_rows(t, amax_blocks, global_amax):
    """1x16 quantization of each row of float32 t [R, C] with per-block amaxes [R, C/16]."""
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        s_enc = np.fmin(F32(2688) / F32(global_amax), FLT_MAX)
        if s_enc == 0:
            s_enc = F32(1)
        gds = F32(1) / s_enc
        mult = s_enc * (F32(1) / F32(6))
        dec = e4m3(np.clip(np.fmin(amax_blocks * mult, FLT_MAX), F32(-448), F32(448)))
        enc = np.fmin(F32(1) / (E4M3[dec].astype(F32) * gds), FLT_MAX)
        enc_el = np.repeat(enc, 16, axis=1)
        q = e2m1(np.clip(t * enc_el, F32(-6), F32(6)))
    signed = np.where(q & 8, -1.0, 1.0) * E2M1[q & 7]
    deq = (signed.astype(F32) * np.repeat(E4M3[dec].astype(F32), 16, axis=1)) * gds
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)
    return packed, dec.astype(np.uint8), deq.astype(F32)


def block_amax(t):
    R, C = t.shape
    return np.abs(t).reshape(R, C // 16, 16).max(axis=2)


def tile_amax_rows(t):
    """Per 1x16 block of t, the amax of its 16x16 tile."""
    R, C = t.shape
    tiles = np.abs(t).reshape(R // 16, 16, C // 16, 16).max(axis=(1, 3))
    return np.repeat(tiles, 16, axis=0)


SIGNS = np.array([1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1], dtype=np.float64)
H16 = np.array([[1.0]])
for _ in range(4):
    H16 = np.block([[H16, H16], [H16, -H16]])  # Sylvester: H[i][j] = (-1)^popcount(i & j)


def rht_rows(t):
    """RHT of each 16-group along the last dim of float32 t: the float64 sum in index order."""
    R, C = t.shape
    g = t.astype(np.float64).reshape(R, C // 16, 16)
    y = np.zeros_like(g)
    for j in range(16):
        acc = np.zeros(g.shape[:2])
        for i in range(16):
            acc = acc + (SIGNS[i] * H16[i, j]) * g[:, :, i]
        y[:, :, j] = 0.25 * acc
    return y.reshape(R, C).astype(F32)


def expected(x, two_d, rht):
    exp = {}
    amax = np.abs(x).max()
    blocks = tile_amax_rows(x) if two_d else block_amax(x)
    d, s, deq = quantize_rows(x, blocks, amax)
    exp.update({"/rowwise/data": d, "/rowwise/scale_inv": s, "/rowwise/dequantized": deq,
                "/rowwise/global_amax": np.array([amax], dtype=F32)})
    t = rht_rows(np.ascontiguousarray(x.T)) if rht else np.ascontiguousarray(x.T)
    camax = np.abs(t).max()
    cblocks = tile_amax_rows(t) if two_d else block_amax(t)
    d, s, deq = quantize_rows(t, cblocks, camax)
    exp.update({"/columnwise/data": d, "/columnwise/scale_inv": s, "/columnwise/dequantized": deq,
                "/columnwise/global_amax": np.array([camax], dtype=F32)})
    return exp


def run(*args):
    return subprocess.run([BIN, "quantize", *args], capture_output=True, text=True)


def write_input(path, x):
    with h5py.File(path, "w") as f:
        f.create_dataset("/x", data=x)


rng = np.random.default_rng(22)


def inputs():
    M, K = 48, 80
    yield "random", rng.normal(0, 2, size=(M, K)).astype(F32)
    x = rng.normal(0, 1, size=(M, K)).astype(F32)
    x[3, 7], x[20, 61], x[40, 2] = 3e4, -1e5, 2.5e4
    x[16:32, 16:32] = 0  # a zero tile / zero blocks
    yield "outlier", x
    x = (rng.normal(0, 1, size=(M, K)) * 1e-39).astype(F32)  # fp32 subnormals
    x[5, 5] = F32(3e-38)
    yield "tiny", x
    # Ties: global amax 2688 (S_enc = 1, gds = 1); in row 1 the first block's amax 12 gives
    # dec = e4m3(12 * fp32(1/6)) = 2 and enc = 0.5, so these scale to the exact E2M1 midpoints
    # 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5 and their negatives.
    x = rng.normal(0, 1, size=(M, K)).astype(F32)
    x[0, 40] = 2688
    ties = np.array([0.5, 1.5, 2.5, 3.5, 5, 7, 10, 12, -0.5, -1.5, -2.5, -3.5, -5, -7, -10, 0.0],
                    dtype=F32)
    x[1, :16] = ties
    x[16:32, 0] = ties  # the same values down a column for the columnwise copy
    yield "tie", x


for name, x in inputs():
    inp = f"{WORK}/{name}_in.h5"
    write_input(inp, x)
    for flags in ([], ["--2d"], ["--rht"]):
        two_d, rht = "--2d" in flags, "--rht" in flags
        out = f"{WORK}/{name}{''.join(flags)}.h5"
        r = run("--recipe", "nvfp4", *flags, "--backend", "cpu", "--in", inp, "--out", out)
        what = f"{name} {' '.join(flags) or '1x16'}"
        check(r.returncode == 0, f"{what}: exit {r.returncode}: {r.stderr}")
        if r.returncode != 0:
            continue
        exp = expected(x, two_d, rht)
        with h5py.File(out, "r") as f:
            for key, want in exp.items():
                got = f[key][()]
                check(got.shape == want.shape, f"{what} {key}: shape {got.shape} != {want.shape}")
                check(got.dtype == want.dtype, f"{what} {key}: dtype {got.dtype} != {want.dtype}")
                if got.shape == want.shape and got.dtype == want.dtype:
                    same = got.tobytes() == want.tobytes()
                    if not same:
                        bad = np.argwhere(got != want)[:3]
                        print(f"  {key} first differences at {bad.tolist()}")
                    check(same, f"{what} {key}: bytes differ")
            check(f.attrs["recipe"] == "nvfp4" and f.attrs["backend"] == "cpu"
                  and f.attrs["2d"] == ("1" if two_d else "0")
                  and f.attrs["rht"] == ("1" if rht else "0"), f"{what}: attributes")
            if name == "tie" and not flags:
                # Ties to even: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4 (values).
                codes = f["/rowwise/data"][1, :8]
                nib = np.stack([codes & 15, codes >> 4], axis=1).reshape(-1)
                want = [0, 2, 2, 4, 4, 6, 6, 7, 8, 10, 10, 12, 12, 14, 14, 0]
                check(nib.tolist() == want, f"tie codes {nib.tolist()} != {want}")
                check(f["/rowwise/scale_inv"][1, 0] == 0x40, "tie block scale is e4m3 2.0")


# ---- bad input: exit 2, message names it, no output left ---------------------------------------
def expect_bad(args, needle, what):
    out = f"{WORK}/bad_out.h5"
    if os.path.exists(out):
        os.remove(out)
    r = run(*args, "--out", out)
    check(r.returncode == 2, f"{what}: exit {r.returncode} (want 2): {r.stderr}")
    check(needle in r.stderr, f"{what}: stderr does not name '{needle}': {r.stderr}")
    check(not os.path.exists(out), f"{what}: output file was written")
    check(not [n for n in os.listdir(WORK) if ".tmp." in n], f"{what}: temp files left")


write_input(f"{WORK}/rows24.h5", np.ones((24, 32), dtype=F32))
expect_bad(["--recipe", "nvfp4", "--in", f"{WORK}/rows24.h5"], "[24, 32]", "rows not x16")
write_input(f"{WORK}/cols40.h5", np.ones((32, 40), dtype=F32))
expect_bad(["--recipe", "nvfp4", "--rht", "--in", f"{WORK}/cols40.h5"], "[32, 40]", "cols not x16")
write_input(f"{WORK}/ok16.h5", np.ones((32, 32), dtype=F32))
expect_bad(["--recipe", "nvfp4", "--2d", "--rht", "--in", f"{WORK}/ok16.h5"], "--2d with --rht",
           "--2d with --rht")
expect_bad(["--recipe", "nvfp4", "--format", "e5m2", "--in", f"{WORK}/ok16.h5"], "--format",
           "--format with nvfp4")
expect_bad(["--recipe", "nvfp4", "--eps", "0.5", "--in", f"{WORK}/ok16.h5"], "--eps",
           "--eps with nvfp4")
expect_bad(["--recipe", "current", "--rht", "--in", f"{WORK}/ok16.h5"], "--rht",
           "--rht with current")

# ---- CUDA backend: the CPU's bytes (only where a device is usable) ------------------------------
env = json.loads(subprocess.run([BIN, "env", "--json"], capture_output=True, text=True).stdout)
if env["cuda"]["usable"]:
    write_input(f"{WORK}/dev_in.h5", rng.normal(0, 3, size=(96, 160)).astype(F32))
    for flags in ([], ["--2d"], ["--rht"]):
        outs = {}
        for backend in ("cpu", "cuda"):
            outs[backend] = f"{WORK}/dev_{backend}.h5"
            r = run("--recipe", "nvfp4", *flags, "--backend", backend, "--in",
                    f"{WORK}/dev_in.h5", "--out", outs[backend])
            check(r.returncode == 0, f"{flags} {backend}: exit {r.returncode}: {r.stderr}")
        with h5py.File(outs["cpu"], "r") as a, h5py.File(outs["cuda"], "r") as b:
            names = []
            a.visit(lambda n: names.append(n) if isinstance(a[n], h5py.Dataset) else None)
            for n in names:
                check(a[n][()].tobytes() == b[n][()].tobytes(), f"{flags}: {n} differs cpu/cuda")
else:
    print("CUDA not usable; cpu/cuda byte comparison skipped:", env["cuda"]["unusable_reason"])

if failures:
    print(f"{len(failures)} check(s) failed")
    sys.exit(1)
print("all nvfp4 quantize verb checks passed")
