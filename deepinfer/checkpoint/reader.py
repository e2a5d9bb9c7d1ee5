"""Open a V4 checkpoint directory, map its names to the official layout, validate it and load it.

Only safetensors and JSON are ever read (nothing is unpickled). Every shard header is parsed here and
checked against the file size before the safetensors library touches the file, so a truncated download
or a corrupt header is one `CheckpointError` line naming the file instead of a Rust panic or a bus error
on a memory-mapped read.

Two layouts are recognised:

* ``official``: the hub checkpoint (``embed.weight``, ``layers.0.attn.wq_a.weight`` + ``.scale``, ...).
* ``transformers``: what ``DeepseekV4ForCausalLM.save_pretrained`` writes (``model.`` prefix, float
  weights only, no MTP block). Names are mapped to the official ones on open.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

import torch
from safetensors import safe_open

from deepinfer.checkpoint.schema import expected_tensors
from deepinfer.config import ModelConfig
from deepinfer.quant.formats import e8m0_to_float

INDEX_NAME = "model.safetensors.index.json"
_HEADER_MAX = 100 << 20  # the safetensors library refuses larger headers too

# safetensors dtype string -> (bytes per element, torch dtype)
_DTYPES = {
    "F64": (8, torch.float64), "F32": (4, torch.float32), "F16": (2, torch.float16),
    "BF16": (2, torch.bfloat16), "I64": (8, torch.int64), "I32": (4, torch.int32),
    "I16": (2, torch.int16), "I8": (1, torch.int8), "U8": (1, torch.uint8), "BOOL": (1, torch.bool),
    "F8_E4M3": (1, torch.float8_e4m3fn), "F8_E5M2": (1, torch.float8_e5m2),
    "F8_E8M0": (1, torch.float8_e8m0fnu), "U16": (2, torch.uint16), "U32": (4, torch.uint32),
    "U64": (8, torch.uint64),
}

# storage kind (schema.TensorSpec.kind, plus "scale" for the ue8m0 siblings) -> accepted dtypes
SCALE_DTYPES = ("F8_E8M0", "U8", "F32")  # U8: raw e8m0 bytes; F32: scales already decoded
ALLOWED_DTYPES = {
    "fp8": ("F8_E4M3",),
    "fp4": ("I8", "U8"),  # two e2m1 codes per byte; signedness of the container does not matter
    "float": ("BF16", "F16", "F32"),
    "int": ("I32", "I64"),
    "scale": SCALE_DTYPES,
}


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; every line says what is wrong and where (file, tensor)."""


@dataclass(frozen=True)
class _Entry:
    """One tensor as stored: `key` is its name inside `file` (before mapping to the official name)."""

    file: str
    key: str
    dtype: str
    shape: tuple
    nbytes: int


def scale_name(weight_name: str) -> str:
    """Official name of a quantised weight's ue8m0 scale: `x.wq_a.weight` -> `x.wq_a.scale`."""
    return weight_name[: -len("weight")] + "scale" if weight_name.endswith(".weight") else weight_name + ".scale"


# --------------------------------------------------------------------------- shard headers


def read_header(path: str) -> dict[str, _Entry]:
    """Parse and check one safetensors header: {stored name: _Entry}. Raises one CheckpointError line.

    Layout: u64 little-endian header length n, n bytes of JSON, then the data; each entry's
    ``data_offsets`` [begin, end) are relative to the data start and must lie inside the file.
    """
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no 8-byte header length)")
            n = int.from_bytes(head, "little")
            if n > _HEADER_MAX or 8 + n > size:
                raise CheckpointError(
                    f"{path}: corrupt or truncated safetensors file: header length {n} runs past the end "
                    f"of the file ({size} bytes)"
                )
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        hdr = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors file: header is not JSON ({_one_line(e)})") from None
    if not isinstance(hdr, dict):
        raise CheckpointError(f"{path}: corrupt safetensors file: header is a JSON {type(hdr).__name__}, not an object")
    data_len = size - 8 - n
    out: dict[str, _Entry] = {}
    for key, info in hdr.items():
        if key == "__metadata__":
            continue
        where = f"{path}: tensor {key!r}"
        try:
            dtype, shape, (b, e) = info["dtype"], tuple(int(s) for s in info["shape"]), info["data_offsets"]
            b, e = int(b), int(e)
        except (TypeError, KeyError, ValueError):
            raise CheckpointError(f"{where}: corrupt header entry {info!r}") from None
        if dtype not in _DTYPES:
            raise CheckpointError(f"{where}: unsupported dtype {dtype!r}")
        numel = 1
        for s in shape:
            numel *= s
        if any(s < 0 for s in shape) or not 0 <= b <= e or e - b != numel * _DTYPES[dtype][0]:
            raise CheckpointError(f"{where}: corrupt header: {dtype} {list(shape)} does not fit offsets [{b}, {e})")
        if e > data_len:
            raise CheckpointError(
                f"{where}: data [{b}, {e}) runs past the end of the file ({data_len} data bytes): "
                "truncated or corrupt file"
            )
        out[key] = _Entry(path, key, dtype, shape, e - b)
    return out


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())


# --------------------------------------------------------------------------- name mapping

_HF_HC_HEAD = re.compile(r"hc_head\.hc_(fn|base|scale)")
_HF_KV_NORM = re.compile(r"(layers\.\d+\.attn\.)norm\.weight")  # the attention's own, not the compressors'


def _from_transformers(name: str) -> str:
    """transformers `save_pretrained` name -> official name (unknown names pass through unchanged)."""
    if name in ("head.weight", "lm_head.weight"):
        return "head.weight"
    if not name.startswith("model."):
        return name
    n = name[len("model."):]
    if n == "embed_tokens.weight":
        return "embed.weight"
    if m := _HF_HC_HEAD.fullmatch(n):
        return f"hc_head_{m[1]}"
    if m := _HF_KV_NORM.fullmatch(n):
        return m[1] + "kv_norm.weight"
    return n


def _ignored_official(name: str) -> bool:
    """MTP copies of the shared embedding / head, which the official convert.py skips."""
    return name.startswith("mtp.") and ("emb" in name or name.endswith("head.weight"))


# --------------------------------------------------------------------------- the checkpoint


class Checkpoint:
    """An opened checkpoint directory: official name -> stored tensor, nothing loaded yet.

    Attributes: `model_dir`, `layout` ("official" | "transformers"), `files` (shard paths, in order),
    `ignored` (stored names deliberately skipped, e.g. MTP copies of embed/head).
    """

    def __init__(self, model_dir: str, layout: str, files: list[str], entries: dict[str, _Entry], ignored: list[str]):
        self.model_dir, self.layout, self.files, self.ignored = model_dir, layout, files, ignored
        self._entries = entries

    def names(self) -> list[str]:
        """Official names of every tensor (file order)."""
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def spec(self, name: str) -> tuple[str, tuple, str]:
        """(safetensors dtype string, stored shape, file path) of official tensor `name`."""
        e = self._entry(name)
        return e.dtype, e.shape, e.file

    def stored_name(self, name: str) -> str:
        """The name `name` carries inside its shard (differs from the official one in `transformers` layout)."""
        return self._entry(name).key

    def nbytes(self) -> int:
        """Bytes of all (non-ignored) tensors as stored."""
        return sum(e.nbytes for e in self._entries.values())

    def by_file(self) -> dict[str, list[tuple[str, _Entry]]]:
        """{file: [(official name, entry), ...]}: lets a loader open each shard once."""
        out: dict[str, list] = {f: [] for f in self.files}
        for name, e in self._entries.items():
            out[e.file].append((name, e))
        return out

    def get(self, name: str, device: str | torch.device = "cpu") -> torch.Tensor:
        """Tensor `name` exactly as stored (dtype, shape), memory-mapped from its shard, then moved to `device`."""
        e = self._entry(name)
        with _open_shard(e.file) as f:
            t = _get(f, e)
        return t.to(device)

    def _entry(self, name: str) -> _Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise CheckpointError(f"{self.model_dir}: no tensor {name!r} in the checkpoint") from None

    def __repr__(self) -> str:
        return f"Checkpoint({self.model_dir!r}, layout={self.layout!r}, {len(self.files)} files, {len(self)} tensors)"


def _open_shard(path: str):
    try:
        return safe_open(path, framework="pt", device="cpu")
    except Exception as e:  # the library's own error type is not importable across versions
        raise CheckpointError(f"{path}: cannot open safetensors file ({_one_line(e)})") from None


def _get(f, e: _Entry) -> torch.Tensor:
    try:
        return f.get_tensor(e.key)
    except Exception as ex:
        raise CheckpointError(f"{e.file}: cannot read tensor {e.key!r} ({_one_line(ex)})") from None


def _shard_files(model_dir: str) -> list[str]:
    """Shard paths from the index if there is one, else every *.safetensors in the directory."""
    index = os.path.join(model_dir, INDEX_NAME)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                wm = json.load(f)["weight_map"]
            if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
                raise TypeError("weight_map is not an object of name -> file")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: malformed index ({_one_line(e) or type(e).__name__})") from None
        shards = sorted(set(wm.values()))
        # Shards live in the model directory; an index must not point outside it.
        bad = [s for s in shards if os.path.isabs(s) or ".." in s.replace("\\", "/").split("/")]
        if bad:
            raise CheckpointError(f"{index}: shard path(s) outside the model directory: {', '.join(bad)}")
        missing = [s for s in shards if not os.path.isfile(os.path.join(model_dir, s))]
        if missing:
            raise CheckpointError(f"{index}: names shard file(s) that do not exist: {', '.join(missing)}")
        return [os.path.join(model_dir, s) for s in shards]
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no {INDEX_NAME} and no *.safetensors file")
    return [os.path.join(model_dir, f) for f in files]


def open_checkpoint(model_dir: str) -> Checkpoint:
    """Open `model_dir`: read every shard header, detect the layout, map names to the official ones.

    Raises CheckpointError (one line naming the file) for a missing directory, malformed index, missing
    shard, truncated/corrupt shard, or two files claiming the same tensor.
    """
    model_dir = os.path.abspath(model_dir)
    if not os.path.isdir(model_dir):
        raise CheckpointError(f"{model_dir}: not a directory")
    files = _shard_files(model_dir)
    stored: dict[str, _Entry] = {}
    for path in files:
        for key, e in read_header(path).items():
            if key in stored:
                raise CheckpointError(f"{path}: tensor {key!r} is also in {stored[key].file}")
            stored[key] = e
    # save_pretrained prefixes everything but the head with `model.`; the official layout never does.
    layout = "transformers" if any(k.startswith("model.") for k in stored) else "official"
    entries: dict[str, _Entry] = {}
    ignored: list[str] = []
    for key, e in stored.items():
        name = _from_transformers(key) if layout == "transformers" else key
        if layout == "official" and _ignored_official(name):
            ignored.append(key)
            continue
        if name in entries:
            raise CheckpointError(f"{e.file}: {key!r} and {entries[name].key!r} both map to official {name!r}")
        entries[name] = e
    return Checkpoint(model_dir, layout, files, entries, ignored)


def mtp_layers_present(ckpt: Checkpoint) -> int:
    """How many MTP blocks the checkpoint holds (distinct `mtp.N.` prefixes): 0 for `transformers`."""
    return len({n.split(".", 2)[1] for n in ckpt.names() if n.startswith("mtp.") and n.count(".") >= 2})


# --------------------------------------------------------------------------- validation


def expected_storage(cfg: ModelConfig) -> dict[str, tuple[str, tuple]]:
    """{official name: (kind, stored shape)} including the `.scale` siblings (kind "scale")."""
    out: dict[str, tuple[str, tuple]] = {}
    for name, spec in expected_tensors(cfg).items():
        out[name] = (spec.kind, tuple(spec.storage_shape()))
        if spec.kind in ("fp8", "fp4"):
            out[scale_name(name)] = ("scale", tuple(spec.scale_shape()))
    return out


def validate(ckpt: Checkpoint, cfg: ModelConfig) -> None:
    """Compare the checkpoint with `expected_tensors(cfg)`; raise ONE CheckpointError listing every problem.

    First line: how many problems and where; then one line each: missing, unexpected (with its file),
    mis-shaped (got vs expected stored shape), mis-typed (got vs allowed dtypes).
    """
    want = expected_storage(cfg)
    problems: list[str] = []
    for name, (kind, shape) in want.items():
        if name not in ckpt:
            problems.append(f"missing tensor {name}")
            continue
        dtype, got, _ = ckpt.spec(name)
        if dtype not in ALLOWED_DTYPES[kind]:
            problems.append(f"mis-typed tensor {name}: {dtype}, expected {' or '.join(ALLOWED_DTYPES[kind])} ({kind})")
        if tuple(got) != shape:
            problems.append(f"mis-shaped tensor {name}: {list(got)}, expected {list(shape)}")
    for name in ckpt.names():
        if name not in want:
            _, _, file = ckpt.spec(name)
            stored = ckpt.stored_name(name)
            problems.append(f"unexpected tensor {name} in {file}" + (f" (stored as {stored})" if stored != name else ""))
    if problems:
        head = (
            f"{len(problems)} problem{'s' if len(problems) > 1 else ''} in checkpoint {ckpt.model_dir} "
            f"(layout {ckpt.layout}) against config {cfg.name or 'given'}:"
        )
        raise CheckpointError("\n".join([head] + ["  " + p for p in problems]))


# --------------------------------------------------------------------------- loading


def _loaded_bytes(e: _Entry, kind: str) -> int:
    """Bytes a tensor occupies after load_state's conversion (scales -> float32, int tables -> int64)."""
    numel = e.nbytes // _DTYPES[e.dtype][0]
    return numel * {"scale": 4, "int": 8}.get(kind, _DTYPES[e.dtype][0])


def _convert(t: torch.Tensor, kind: str, dtype: str) -> torch.Tensor:
    if kind == "scale":
        # Raw bytes are exponents: decode them, never `.float()` them (byte 130 means 8.0, not 130.0).
        return t if dtype == "F32" else e8m0_to_float(t)
    if kind == "fp4":
        return t.view(torch.int8)  # same bits; one container dtype for the kernels
    if kind == "int":
        return t.to(torch.int64)
    return t  # fp8 stays float8_e4m3fn, floats stay as stored


def _check_fits(ckpt: Checkpoint, need: int, device: torch.device) -> None:
    if device.type != "cuda":
        return
    free, _ = torch.cuda.mem_get_info(device)
    if need > free:
        raise CheckpointError(
            f"{ckpt.model_dir}: needs {need / 2**30:.2f} GiB, device {device} has {free / 2**30:.2f} GiB free"
        )


_EXPERT = re.compile(r"(?:layers|mtp)\.\d+\.ffn\.experts\.(\d+)\.")


def routed_expert(name: str) -> int | None:
    """The routed expert id a tensor belongs to (`layers.3.ffn.experts.17.w1.weight` -> 17), else None."""
    m = _EXPERT.match(name)
    return int(m[1]) if m else None


def load_state(
    ckpt: Checkpoint, cfg: ModelConfig, device: str | torch.device = "cpu", progress: bool = True,
    expert_range: tuple[int, int] | None = None,
) -> dict[str, torch.Tensor]:
    """Validate, then load every tensor shard by shard (each file opened once), memory-mapped, to `device`.

    `expert_range` (lo, hi): load only routed experts lo..hi-1 (expert parallelism); the others are never
    read, but validation still checks the whole checkpoint.
    Returns {official name: tensor} in `expected_tensors` order:
    fp8 weights float8_e4m3fn [N, K]; fp4 weights int8 [N, K/2]; `.scale` float32 (e8m0 decoded);
    floats as stored; int tables int64. Ignored MTP copies are not loaded.
    """
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    validate(ckpt, cfg)
    want = expected_storage(cfg)
    if expert_range is not None:
        lo, hi = expert_range
        want = {n: v for n, v in want.items() if (e := routed_expert(n)) is None or lo <= e < hi}
    device = torch.device(device)
    _check_fits(ckpt, sum(_loaded_bytes(ckpt._entry(n), k) for n, (k, _) in want.items()), device)
    out: dict[str, torch.Tensor] = {}
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeRemainingColumn())
    err = Console(stderr=True)
    # a bar only on a terminal: on a pipe or a log file a transient bar leaves an empty line behind
    with Progress(*columns, console=err, disable=not progress or not err.is_terminal, transient=True) as bar:
        total = sum(ckpt._entry(n).nbytes for n in want)
        task = bar.add_task(f"loading {os.path.basename(ckpt.model_dir)}", total=total)
        for path, entries in ckpt.by_file().items():
            entries = [(name, e) for name, e in entries if name in want]
            if not entries:
                continue
            with _open_shard(path) as f:
                for name, e in entries:
                    out[name] = _convert(_get(f, e).to(device), want[name][0], e.dtype)
                    bar.advance(task, e.nbytes)
    return {n: out[n] for n in want}
