"""HDF5 dump files: a generic, lossless store of named tensors with attributes (schema in `dumps/README.md`).

Layout (format `deepinfer-dump`, version 1):

    /                 attrs: format, format_version, then the run's fingerprint (str/int/float/bool)
    /tensors/<name>   one dataset per tensor, flat (names keep their dots; `/` is not allowed)
                      attrs: dtype (torch dtype name), order (capture index), plus any caller attrs

bfloat16 and the float8 types have no HDF5/numpy type: they are stored as their raw bits (uint16 / uint8)
and the `dtype` attribute says how to reinterpret them, so every dtype decodes back bit-exactly.
Non-empty arrays are chunked and gzip+shuffle compressed.

`DumpWriter` writes to a temporary file next to the target and renames it only when the `with` block
ends cleanly: an exception or an interrupt never leaves a partial file at the target path. The target
must be a regular file or a new name in an existing directory (`deepinfer.outpath.check_output`).
Nothing here knows about the model, so `deepinfer ab --dump` can reuse it for kernel outputs.
"""

from __future__ import annotations

import os
from typing import Iterator

import numpy as np
import torch

from deepinfer.outpath import check_output, real_path, temp_path

FORMAT = "deepinfer-dump"
FORMAT_VERSION = 1

# torch dtypes numpy cannot hold: stored as raw bits of this torch integer type, decoded via `view`.
_RAW_BITS = {
    torch.bfloat16: torch.int16,
    torch.float8_e4m3fn: torch.uint8,
    torch.float8_e5m2: torch.uint8,
}
for _n in ("float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"):
    if hasattr(torch, _n):
        _RAW_BITS[getattr(torch, _n)] = torch.uint8


class DumpError(ValueError):
    """A file that cannot be read as a dump (missing, not HDF5, not our format, bad entry)."""


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise DumpError(f"unknown tensor dtype {name!r} in dump")
    return dt


def encode(t: torch.Tensor) -> tuple[np.ndarray, str]:
    """Tensor (any device) -> (numpy array HDF5 can store, torch dtype name). Bit-exact."""
    t = t.detach().to("cpu").contiguous()
    name = dtype_name(t.dtype)
    raw = _RAW_BITS.get(t.dtype)
    if raw is not None:
        arr = t.view(raw).numpy()
        # bf16 bits as uint16 (int16 is only the torch view; numpy's uint16 is the documented storage)
        return (arr.view(np.uint16) if raw == torch.int16 else arr), name
    return t.numpy(), name


def decode(arr: np.ndarray, name: str) -> torch.Tensor:
    """Inverse of `encode`."""
    dt = torch_dtype(name)
    raw = _RAW_BITS.get(dt)
    a = np.array(arr, copy=True, order="C")  # (ascontiguousarray would turn a 0-d array into 1-d)
    if raw is not None:
        if raw == torch.int16:
            a = a.view(np.int16)
        return torch.from_numpy(a).view(dt)
    return torch.from_numpy(a).to(dt)


def _attr_value(v):
    """HDF5 attributes cannot hold None or nested objects: None -> "", others -> str."""
    if v is None:
        return ""
    if isinstance(v, str):
        return str(v)  # str subclasses (torch's TorchVersion) have no HDF5 conversion
    if isinstance(v, (bool, int, float, np.generic)):
        return v
    if isinstance(v, (list, tuple)) and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
        return np.asarray(v)
    return str(v)


def _plain(v):
    """HDF5 attribute -> plain Python value."""
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, np.generic):
        return v.item()
    return v


class DumpWriter:
    """`with DumpWriter(path, attrs) as w: w.add(name, tensor, **attrs)`; the file appears at the end."""

    def __init__(self, path: str | os.PathLike, attrs: dict | None = None, compression: int = 4):
        self.path = real_path(os.fspath(path))  # a symlink's target is replaced, not the link
        self.attrs = dict(attrs or {})
        self.compression = compression
        self.tmp = temp_path(self.path)
        self._f = None
        self._order = 0

    def __enter__(self) -> "DumpWriter":
        import h5py

        check_output(self.path, "dump file")  # never a directory or a device node; parents must exist
        self._f = h5py.File(self.tmp, "w")
        try:
            self._f.attrs["format"] = FORMAT
            self._f.attrs["format_version"] = FORMAT_VERSION
            for k, v in self.attrs.items():
                self._f.attrs[k] = _attr_value(v)
            self._g = self._f.create_group("tensors")
        except BaseException as e:  # __exit__ does not run when __enter__ fails: clean up here
            self.__exit__(type(e), e, None)
            raise
        return self

    def add(self, name: str, t: torch.Tensor, **attrs) -> None:
        """Store `t` under `name` (unique; no `/`). `order` defaults to the call order."""
        if "/" in name or not name or name in (".", ".."):
            raise ValueError(f"tensor name {name!r}: must be non-empty and contain no '/'")
        if name in self._g:
            raise ValueError(f"tensor {name!r} written twice")
        arr, dt = encode(t)
        kw = {}
        if arr.ndim > 0 and arr.size > 0:  # HDF5 cannot chunk scalars or empty extents
            kw = dict(chunks=True, compression="gzip", compression_opts=self.compression, shuffle=True)
        ds = self._g.create_dataset(name, data=arr, **kw)
        ds.attrs["dtype"] = dt
        ds.attrs["order"] = int(attrs.pop("order", self._order))
        for k, v in attrs.items():
            ds.attrs[k] = _attr_value(v)
        self._order += 1

    def __exit__(self, exc_type, exc, tb) -> None:
        f, self._f = self._f, None
        try:
            f.close()
        except Exception:
            if exc_type is None:
                raise
        if exc_type is None:
            os.replace(self.tmp, self.path)  # atomic on one filesystem: readers see all or nothing
        else:  # any failure, KeyboardInterrupt included: no partial file anywhere
            try:
                os.unlink(self.tmp)
            except FileNotFoundError:
                pass


class DumpReader:
    """Read-only view of a dump: root `attrs`, `names()` in capture order, `meta(name)`, `tensor(name)`.

    Tensors load lazily (a compare of two large dumps holds two tensors at a time).
    """

    def __init__(self, path: str | os.PathLike):
        import h5py

        self.path = os.fspath(path)
        if not os.path.exists(self.path):
            raise DumpError(f"{self.path}: no such file")
        if os.path.isdir(self.path):
            raise DumpError(f"{self.path}: is a directory, not a dump file")
        try:
            self._f = h5py.File(self.path, "r")
        except OSError as e:
            raise DumpError(f"{self.path}: not a readable HDF5 file ({_short(e)})") from None
        if self._f.attrs.get("format") not in (FORMAT, FORMAT.encode()) or "tensors" not in self._f:
            self._f.close()
            raise DumpError(f"{self.path}: an HDF5 file but not a deepinfer dump (no format={FORMAT} attribute)")
        v = int(self._f.attrs.get("format_version", 0))
        if v > FORMAT_VERSION:
            self._f.close()
            raise DumpError(f"{self.path}: dump format version {v} is newer than this deepinfer reads ({FORMAT_VERSION})")
        self.attrs = {k: _plain(v) for k, v in self._f.attrs.items()}
        g = self._f["tensors"]
        self._meta = {}
        for name, ds in g.items():
            m = {k: _plain(v) for k, v in ds.attrs.items()}
            m["shape"] = tuple(ds.shape)
            m.setdefault("dtype", str(ds.dtype))
            m.setdefault("order", 1 << 62)
            self._meta[name] = m
        self._names = sorted(self._meta, key=lambda n: (self._meta[n]["order"], n))

    def names(self) -> list[str]:
        return list(self._names)

    def __contains__(self, name: str) -> bool:
        return name in self._meta

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def meta(self, name: str) -> dict:
        return self._meta[name]

    def tensor(self, name: str) -> torch.Tensor:
        try:
            return decode(self._f["tensors"][name][()], self._meta[name]["dtype"])
        except KeyError:
            raise
        except Exception as e:
            raise DumpError(f"{self.path}: tensor {name!r} unreadable ({_short(e)})") from None

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> "DumpReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _short(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def write_dump(path, tensors, attrs: dict | None = None) -> None:
    """Write (name, tensor) pairs or a dict in one go (atomic)."""
    items = tensors.items() if isinstance(tensors, dict) else tensors
    with DumpWriter(path, attrs) as w:
        for name, t in items:
            w.add(name, t)


def read_dump(path) -> tuple[dict, dict[str, torch.Tensor]]:
    """Whole file -> (root attrs, {name: tensor} in capture order). For small dumps and tests."""
    with DumpReader(path) as r:
        return dict(r.attrs), {n: r.tensor(n) for n in r.names()}
