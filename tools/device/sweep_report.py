"""What the device sweeps (fp4_decode_sweep.py, fp8_exact_sweep.py) share: their command line and their report."""

from __future__ import annotations

import argparse
import json
import os

import torch


def parse(argv: list[str], name: str, smoke_help: str) -> argparse.Namespace:
    """--smoke (CPU, the interpreter, no timing) and --out (default $OUT/<name>.json)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help=smoke_help)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), f"{name}.json"))
    return ap.parse_args(argv)


def write(path: str, dev: str, rows: list[dict]) -> str:
    """The rows with the device and versions, written atomically as JSON; returns the line that names them."""
    import triton

    dev_name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    doc = {"device": dev_name, "torch": torch.__version__, "triton": triton.__version__, "rows": rows}
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)
    return f"{dev_name}, torch {torch.__version__}, triton {triton.__version__}"
