"""Write a checkpoint directory (safetensors shards + index + config.json) atomically.

Everything is written into a temporary sibling of `out_dir` and renamed into place at the end, so a
reader (or a concurrent writer) never sees a half-written model: `out_dir` either does not exist or is
complete.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import torch
from safetensors.torch import save_file

from deepinfer.quant.formats import e8m0_bytes_as_dtype

from deepinfer.checkpoint.reader import INDEX_NAME


def _prepare(name: str, t: torch.Tensor, seen: set[int]) -> torch.Tensor:
    """CPU, contiguous, owning its storage (safetensors refuses shared storage); uint8 scales -> F8_E8M0.

    `seen` collects storage pointers already used, so a tensor passed twice (tied weights) is copied.
    """
    t = t.detach().to("cpu").contiguous()
    ptr = t.untyped_storage().data_ptr()
    if t.untyped_storage().nbytes() != t.nbytes or t.storage_offset() or (t.nbytes and ptr in seen):
        t = t.clone()  # a view into a larger tensor, or storage shared with another entry
    seen.add(t.untyped_storage().data_ptr())
    if name.endswith(".scale") and t.dtype == torch.uint8:
        # Raw e8m0 bytes: store them under their real dtype so readers cannot mistake them for integers.
        t = e8m0_bytes_as_dtype(t)
    return t


def _shard_groups(tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[list[str]]:
    """Split names, in order, into groups of at most max_shard_bytes (a larger single tensor gets its own)."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        nb = t.nbytes
        if groups[-1] and size + nb > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nb
    return groups


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_checkpoint(
    out_dir: str,
    tensors: dict[str, torch.Tensor],
    config_json: dict,
    max_shard_bytes: int = 2 << 30,
    extra_files: dict[str, str] | None = None,
) -> str:
    """Write `tensors` as `model-0000i-of-0000n.safetensors` shards + index + config.json; return out_dir.

    tensors: {name: tensor}, written in this order; uint8 tensors named `*.scale` are raw ue8m0 bytes and
    are stored as F8_E8M0. extra_files: {file name: text} written alongside. Raises FileExistsError if
    out_dir exists (before writing, or because another writer's rename won the race).
    """
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir):
        raise FileExistsError(f"{out_dir}: already exists; write_checkpoint never overwrites a model directory")
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    try:
        seen: set[int] = set()
        prepared = {n: _prepare(n, t, seen) for n, t in tensors.items()}
        groups = _shard_groups(prepared, max_shard_bytes)
        weight_map: dict[str, str] = {}
        for i, names in enumerate(groups, 1):
            fname = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
            path = os.path.join(tmp, fname)
            save_file({n: prepared[n] for n in names}, path, metadata={"format": "pt"})
            _fsync(path)
            weight_map.update({n: fname for n in names})
        index = {"metadata": {"total_size": sum(t.nbytes for t in prepared.values())}, "weight_map": weight_map}
        texts = {INDEX_NAME: json.dumps(index, indent=2), "config.json": json.dumps(config_json, indent=2)}
        texts.update(extra_files or {})
        for fname, text in texts.items():
            with open(os.path.join(tmp, fname), "w", encoding="utf-8") as f:
                f.write(text + ("" if text.endswith("\n") else "\n"))
                f.flush()
                os.fsync(f.fileno())
        # mkdtemp makes the dir 0700 (and safetensors its files 0600): give them the usual umask modes.
        umask = os.umask(0)
        os.umask(umask)
        for fname in os.listdir(tmp):
            os.chmod(os.path.join(tmp, fname), 0o666 & ~umask)
        os.chmod(tmp, 0o777 & ~umask)
        try:
            os.rename(tmp, out_dir)
        except OSError as e:
            if os.path.exists(out_dir):  # ENOTEMPTY/EEXIST: someone else finished first
                raise FileExistsError(f"{out_dir}: created concurrently by another writer") from e
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
