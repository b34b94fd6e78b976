"""Reads a meshproof checkpoint with h5py alone (no meshproof code) and writes every key's global
tensor, reassembled from the rank files' chunks, as raw bytes to OUT/<key with '/' -> '__'>.bin.

Checks on the way: each chunk dataset exists in its rank file, has the index's extent, a plain
numpy dtype (float32/float64/int32/int64/uint8/uint16, never opaque) that matches the `dtype`
attribute's storage width, and `key`/`global_offset` attributes that agree with the index.
Exit 0 on success, 1 with a message on the first violation.

usage: read_with_h5py.py CHECKPOINT_DIR OUT_DIR
"""
import json
import os
import sys

import h5py
import numpy as np

STORAGE = {
    "float32": np.float32, "float64": np.float64, "int32": np.int32, "int64": np.int64,
    "bfloat16": np.uint16, "float16": np.uint16, "e4m3": np.uint8, "e5m2": np.uint8,
    "e8m0": np.uint8, "uint8": np.uint8,
}


def fail(msg):
    print(f"read_with_h5py: {msg}")
    sys.exit(1)


def main():
    ckpt, out = sys.argv[1], sys.argv[2]
    with open(os.path.join(ckpt, "index.json")) as f:
        index = json.load(f)
    os.makedirs(out, exist_ok=True)
    for key, rec in index["keys"].items():
        want = STORAGE[rec["dtype"]]
        glob = np.zeros(rec["shape"], dtype=want)
        for c in rec["chunks"]:
            with h5py.File(os.path.join(ckpt, c["file"]), "r") as h5:
                if c["dataset"] not in h5:
                    fail(f"{key}: {c['dataset']} missing from {c['file']}")
                ds = h5[c["dataset"]]
                if ds.dtype != np.dtype(want):
                    fail(f"{key}: dataset dtype {ds.dtype}, expected {np.dtype(want)}")
                attr = ds.attrs["dtype"]
                attr = attr.decode() if isinstance(attr, bytes) else str(attr)
                if attr != rec["dtype"]:
                    fail(f"{key}: dtype attribute {attr!r}, index {rec['dtype']!r}")
                k = ds.attrs["key"]
                k = k.decode() if isinstance(k, bytes) else str(k)
                if k != key:
                    fail(f"{key}: key attribute {k!r}")
                if list(ds.shape) != c["extent"]:
                    fail(f"{key}: shape {ds.shape}, extent {c['extent']}")
                if list(ds.attrs["global_offset"]) != c["offset"]:
                    fail(f"{key}: global_offset {list(ds.attrs['global_offset'])}, "
                         f"index {c['offset']}")
                sl = tuple(slice(o, o + e) for o, e in zip(c["offset"], c["extent"]))
                glob[sl] = ds[()]
        with open(os.path.join(out, key.replace("/", "__") + ".bin"), "wb") as f:
            f.write(glob.tobytes())
    print(f"read {len(index['keys'])} keys")


if __name__ == "__main__":
    main()
