#!/usr/bin/env python3
"""Rebuild the default target (SmolLM2-135M-Instruct, bf16) on the H200 from its 98 MB GGUF.

The H200 has no package index and takes ~55 MB per device call, so we stage the GGUF (not the
270 MB bf16 weights) plus the small tokenizer/config files written here by `dflash import`, and
dequantize there with gguf-py through the same conversion code `dflash import` uses.

    python3 scripts/h200_target.py GGUF TOKENIZER_DIR OUT_DIR [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))  # convert.py stands alone


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf")
    ap.add_argument("tokenizer_dir", help="a `dflash import` output: config.json + tokenizer files")
    ap.add_argument("out")
    ap.add_argument("--dtype", default="bfloat16")
    a = ap.parse_args()

    import mlx.core as mx
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize

    import convert

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    src = Path(a.tokenizer_dir)
    for f in src.iterdir():
        if f.name != "model.safetensors" and f.is_file():
            shutil.copy(f, out / f.name)
    config = json.loads((src / "config.json").read_text())
    config["torch_dtype"] = a.dtype
    reader = GGUFReader(a.gguf)
    arch = convert.read_metadata(reader)["general.architecture"]
    weights = {}
    for t in reader.tensors:
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        w = w.reshape([int(d) for d in reversed(t.shape)])
        w = convert.convert_tensor(arch, t.name, w, config)
        weights[convert.hf_name(arch, t.name)] = mx.array(w).astype(getattr(mx, a.dtype))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(f"wrote {out}: {len(weights)} tensors, {a.dtype}")


if __name__ == "__main__":
    main()
