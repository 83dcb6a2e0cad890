"""A GGUF file, memory-mapped: its metadata and its tensors as the file stores them.

The header is parsed here rather than with gguf-py's reader, which decodes every token string of
the vocabulary in Python (11 s for a 151k-token vocabulary); string arrays are skipped (the
tokenizer is converted once by transformers and cached). Tensor data is never copied: each tensor
is a uint8 view [rows, bytes per row] of one private (copy-on-write) mapping of the file, so pages
are read from the page cache as the kernels first touch them and resident memory stays near the
size of the tensors used.

Every inconsistency (a truncated file, a tensor whose data lies past its end, a size that does not
match its type) is a GGUFError naming the file and, where there is one, the tensor.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

# ggml tensor types: id -> (name, elements per block, bytes per block)
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36), 10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292), 16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8),
    28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66),
}
# The types this package computes with: integer kernels for the quantized ones, float for the rest.
QUANTIZED = frozenset({"Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"})
FLOAT = frozenset({"F32", "F16", "BF16"})
# Types computed as another type that holds their numbers exactly (a copy made at load; nothing is
# rounded again): Q5_0's d * (q - 16), q in [0, 31], is Q8_0's d * q' with q' = q - 16 and the same
# d. llama.cpp's k-quant mixes store tensors whose rows are not whole 256-element super-blocks as
# Q5_0 (all of Qwen2.5-0.5B's 896-wide projections and its embedding in a Q4_K_M file).
CONVERTED = frozenset({"Q5_0"})
SUPPORTED = QUANTIZED | FLOAT | CONVERTED

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    """A GGUF file that cannot be read as one, or a tensor in it that cannot be used."""


@dataclass(frozen=True)
class StringArray:
    """A string array of the metadata, not decoded (the vocabulary): its length, and where its bytes
    lie in the file (`GGUFFile.raw`: two files' vocabularies compare as bytes)."""

    count: int
    start: int = 0
    end: int = 0


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    type_id: int
    shape: tuple[int, ...]  # ggml order reversed: (rows, ..., columns)
    offset: int  # from the start of the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return GGML_TYPES[self.type_id][0] if self.type_id in GGML_TYPES else f"type {self.type_id}"

    @property
    def rows(self) -> int:
        return int(np.prod(self.shape[:-1])) if len(self.shape) > 1 else 1

    @property
    def cols(self) -> int:
        return self.shape[-1]


class _Cursor:
    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf = buf
        self.pos = 0
        self.path = path

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise GGUFError(f"model: {self.path} is truncated or corrupt (its header runs past the end of the "
                            f"file at byte {self.pos})")
        view = memoryview(self.buf)[self.pos:self.pos + n]
        self.pos += n
        return view

    def scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.scalar("<Q")
        if n > 1 << 30:
            raise GGUFError(f"model: {self.path} is corrupt (a string of {n} bytes in its header)")
        return bytes(self.take(n)).decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            inner, count = self.scalar("<I"), self.scalar("<Q")
            if inner in _NUMPY:
                size = np.dtype(_NUMPY[inner]).itemsize
                return np.frombuffer(self.take(count * size), dtype=_NUMPY[inner]).copy()
            if inner == _STRING:  # skipped, not decoded
                start = self.pos
                self.pos = _skip_strings(self.buf, self.pos, count, self.path)
                return StringArray(count, start, self.pos)
            return [self.value(inner) for _ in range(count)]
        raise GGUFError(f"model: {self.path} is corrupt (metadata value of unknown type {kind})")


def _skip_strings(buf: mmap.mmap, pos: int, count: int, path: Path) -> int:
    """The position after `count` GGUF strings starting at `pos` (walked natively: a 151k-token
    vocabulary and its merges took 0.1 s of a start in Python)."""
    from specserve.model import ops

    ops.load()
    end = int(torch.ops.specserve.gguf_skip_strings(torch.frombuffer(buf, dtype=torch.uint8), pos, count))
    if end < 0:
        raise GGUFError(f"model: {path} is truncated or corrupt (a string array runs past the end of the file)")
    return end


class GGUFFile:
    """A GGUF file's metadata (`metadata`), tensor table (`tensors`) and data (`data(name)`)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except (OSError, ValueError) as e:
            raise GGUFError(f"model: cannot map {self.path}: {e}") from None
        cur = _Cursor(self._map, self.path)
        if bytes(cur.take(4)) != b"GGUF":
            raise GGUFError(f"model: {self.path} is not a GGUF file (no GGUF magic)")
        self.version = cur.scalar("<I")
        if self.version not in (2, 3):
            raise GGUFError(f"model: {self.path} is GGUF version {self.version}; versions 2 and 3 are supported")
        n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
        if n_tensors > 1 << 24 or n_kv > 1 << 24:
            raise GGUFError(f"model: {self.path} is corrupt ({n_tensors} tensors, {n_kv} metadata entries)")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.scalar("<I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.scalar("<I")
            if n_dims > 4:
                raise GGUFError(f"model: {self.path}: tensor {name!r} has {n_dims} dimensions")
            dims = tuple(cur.scalar("<Q") for _ in range(n_dims))
            infos.append((name, dims, cur.scalar("<I"), cur.scalar("<Q")))
        align = int(self.metadata.get("general.alignment", 32))
        start = -(-cur.pos // align) * align
        self.tensors: dict[str, GGUFTensor] = {}
        for name, dims, type_id, rel in infos:
            shape = tuple(int(d) for d in reversed(dims)) or (1,)
            nbytes = -1
            if type_id in GGML_TYPES:
                _, elems, size = GGML_TYPES[type_id]
                nbytes = int(np.prod(shape)) // elems * size
            tensor = GGUFTensor(name, type_id, shape, start + rel, nbytes)
            if nbytes >= 0 and tensor.offset + nbytes > len(self._map):
                raise GGUFError(f"model: {self.path} is truncated: tensor {name!r} ({tensor.type_name}, "
                                f"{nbytes} bytes at {tensor.offset}) ends past the end of the file "
                                f"({len(self._map)} bytes)")
            self.tensors[name] = tensor
        self._array = np.frombuffer(self._map, dtype=np.uint8)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise GGUFError(f"model: {self.path} has no {key!r} in its metadata")
        return self.metadata[key]

    def raw(self, array: StringArray) -> bytes:
        """The bytes of a metadata string array, as stored."""
        return bytes(self._map[array.start:array.end])

    def tensor(self, name: str) -> GGUFTensor:
        if name not in self.tensors:
            raise GGUFError(f"model: {self.path} has no tensor {name!r}")
        return self.tensors[name]

    def data(self, name: str, allowed: frozenset[str] = SUPPORTED) -> torch.Tensor:
        """The tensor's bytes, uint8 [rows, bytes per row], a view of the mapping (no copy)."""
        t = self.tensor(name)
        if t.type_name not in allowed:
            raise GGUFError(f"model: {self.path}: tensor {name!r} is {t.type_name}, which this engine cannot "
                            f"compute with (supported: {', '.join(sorted(allowed))})")
        _, elems, size = GGML_TYPES[t.type_id]
        if t.cols % elems:
            raise GGUFError(f"model: {self.path}: tensor {name!r} has rows of {t.cols} elements, not whole "
                            f"{t.type_name} blocks of {elems}")
        row_bytes = t.cols // elems * size
        view = self._array[t.offset:t.offset + t.nbytes].reshape(t.rows, row_bytes)
        return torch.from_numpy(view)

    def blocks(self, name: str) -> tuple[torch.Tensor, int]:
        """A quantized tensor as blocks a kernel computes with, and their type id: the mapping's
        own bytes (a view) for the QUANTIZED types, an exact conversion (a copy) for CONVERTED."""
        t = self.tensor(name)
        if t.type_name == "Q5_0":
            return q5_0_as_q8_0(self.data(name, CONVERTED), t.cols), 8  # 8: Q8_0
        return self.data(name, QUANTIZED), t.type_id

    def release(self, name: str, row0: int = 0, row1: int | None = None) -> None:
        """Drop this process's copies of a tensor's pages (the whole pages inside its rows
        [row0, row1), all by default), once what was made from them no longer reads them: they leave
        the resident size, and a later read of the tensor pages them in again from the file."""
        t = self.tensor(name)
        row_bytes = t.nbytes // t.rows
        row1 = t.rows if row1 is None else row1
        page = mmap.PAGESIZE
        start = -(-(t.offset + row0 * row_bytes) // page) * page
        end = (t.offset + row1 * row_bytes) // page * page
        if end > start:
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)

    def floats(self, name: str) -> torch.Tensor:
        """A small tensor (a norm, a bias) as float32 [shape], copied out of the mapping."""
        from specserve.model import ops

        ops.load()
        t = self.tensor(name)
        blocks = self.data(name)
        return torch.ops.specserve.gguf_dequantize(blocks, t.type_id, t.cols).reshape(t.shape).clone()


def q5_0_as_q8_0(raw: torch.Tensor, cols: int) -> torch.Tensor:
    """uint8 [rows, 22 * n] Q5_0 blocks -> uint8 [rows, 34 * n] Q8_0 blocks with the same numbers
    (the specserve::gguf_q5_0_as_q8_0 kernel; ggml's block_q5_0: fp16 d, 32 high bits, 16 bytes of
    low nibbles; Q8_0: fp16 d, then the 32 int8 elements)."""
    from specserve.model import ops

    ops.load()
    return torch.ops.specserve.gguf_q5_0_as_q8_0(raw.contiguous(), cols)
