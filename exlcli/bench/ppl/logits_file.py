"""The reference run's log-probabilities (`--save-logits`), in llama-perplexity's own file layout, so
that a file saved by either tool can be compared against a run of the other (`--kl-divergence`).

Layout (little-endian), as perplexity.cpp writes it:
  b"_logits_", int32 n_ctx, int32 n_vocab, int32 n_chunk, int32 tokens[n_chunk * n_ctx] (the text's
  tokens, before the BOS replacement), then for every scored token (n_ctx - 1 - n_ctx / 2 per chunk,
  in order) one row of nv = 2 * ceil(n_vocab / 2) + 4 uint16: two fp32 (scale, min_log_prob), then
  n_vocab codes with log p = scale * code + min_log_prob over the 16 nats below the top log-prob
  (codes below that range are 0). exlcli appends a trailer that llama.cpp never reads: a JSON
  object (the model, its quantization, n_ctx, n_chunk, n_vocab), its uint32 length, b"_exlcli_".

Why this and not fp16 log-probs or top-k: it is the same size as fp16 (2 bytes per vocabulary entry:
98 KiB per scored token at a 49,152 vocabulary, 200 MB for 8 chunks of 512) with a 16 / 65535 nat
step (an error of at most 1.2e-4 nats on every log-prob, against up to 8e-3 for fp16 at -20), and a
top-k file, though hundreds of times smaller, drops the tail, and with it about the tail's share of
the KLD (a perturbation spread over the vocabulary contributes in proportion to probability).
Measured on the default model (SmolLM2-135M, 8 chunks of 512 of a README): on average 5.1% of the
probability lies outside the top 256 tokens, 1.9% outside the top 1024; too much for a number users
judge quants by. Same layout as llama.cpp also means the same rounding, so the two tools' KLDs agree.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

from exlcli.errors import ExlcliError

MAGIC = b"_logits_"
TRAILER_MAGIC = b"_exlcli_"
LOG_PROB_RANGE = 16.0  # nats below the top log-prob that a row keeps


class LogitsFileError(ExlcliError):
    """A saved-logits file cannot be read, or was saved for another run."""


def row_width(n_vocab: int) -> int:
    """uint16 entries per saved row: the two fp32 and the codes, padded to an even count."""
    return 2 * ((n_vocab + 1) // 2) + 4


def encode_rows(logits: torch.Tensor) -> np.ndarray:
    """fp32 logits [R, V] -> uint16 rows [R, row_width(V)], as perplexity.cpp's log_softmax encodes them."""
    logits = logits.float()
    rows, n_vocab = logits.shape
    top = logits.amax(-1, keepdim=True)
    floor = torch.maximum(logits.amin(-1, keepdim=True), top - LOG_PROB_RANGE)
    log_sum_exp = torch.log(torch.exp((logits - top).double()).sum(-1, keepdim=True)).float()
    scale = (top - floor) / 65535.0
    codes = torch.round((logits - floor) / torch.where(scale > 0, scale, torch.ones_like(scale)))
    codes = torch.where((logits > floor) & (scale > 0), codes, torch.zeros_like(codes)).clamp(0, 65535)
    out = np.zeros((rows, row_width(n_vocab)), dtype=np.uint16)
    heads = torch.cat([scale, floor - top - log_sum_exp], dim=1).numpy().astype("<f4")  # [R, 2]
    out[:, :4] = heads.view(np.uint16)
    out[:, 4:4 + n_vocab] = codes.to(torch.int32).numpy().astype(np.uint16)
    return out


def decode_rows(rows: np.ndarray, n_vocab: int) -> torch.Tensor:
    """uint16 rows [R, row_width] -> the log-probs [R, V] they hold (fp32)."""
    heads = torch.from_numpy(np.ascontiguousarray(rows[:, :4]).view("<f4").astype(np.float32))  # [R, 2]
    codes = torch.from_numpy(rows[:, 4:4 + n_vocab].astype(np.float32))
    return heads[:, :1] * codes + heads[:, 1:2]


@dataclass(frozen=True)
class LogitsHeader:
    n_ctx: int
    n_vocab: int
    n_chunk: int
    model: str = "unknown (saved by llama-perplexity)"
    quantization: str = ""

    @property
    def scored_per_chunk(self) -> int:
        return self.n_ctx - 1 - self.n_ctx // 2

    def size_without_trailer(self) -> int:
        rows = self.n_chunk * self.scored_per_chunk
        return len(MAGIC) + 12 + 4 * self.n_chunk * self.n_ctx + 2 * rows * row_width(self.n_vocab)


class LogitsWriter:
    """Writes the file chunk by chunk; `close` adds the trailer."""

    def __init__(self, path: Path, header: LogitsHeader, tokens: list[int]) -> None:
        if len(tokens) != header.n_chunk * header.n_ctx:
            raise ValueError("the file holds n_chunk * n_ctx tokens")
        self.header = header
        try:
            self._f: BinaryIO = open(path, "wb")
        except OSError as e:
            raise LogitsFileError(f"cannot write {path}: {e.strerror}") from None
        self.path = path
        self._f.write(MAGIC + struct.pack("<iii", header.n_ctx, header.n_vocab, header.n_chunk))
        self._f.write(np.asarray(tokens, dtype="<i4").tobytes())

    def write(self, logits: torch.Tensor) -> None:
        self._f.write(encode_rows(logits).tobytes())

    def close(self) -> None:
        h = self.header
        trailer = json.dumps({"model": h.model, "quantization": h.quantization, "n_ctx": h.n_ctx,
                              "n_chunk": h.n_chunk, "n_vocab": h.n_vocab}).encode()
        self._f.write(trailer + struct.pack("<I", len(trailer)) + TRAILER_MAGIC)
        self._f.close()

    def discard(self) -> None:
        self._f.close()
        self.path.unlink(missing_ok=True)


class LogitsReader:
    """A saved file, checked whole on opening; `rows(chunk)` maps one chunk's rows."""

    def __init__(self, path: Path) -> None:
        self.path = path
        if not path.is_file():
            raise LogitsFileError(f"no such logits file: {path}")
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(len(MAGIC) + 12)
            if len(head) < len(MAGIC) + 12 or head[:len(MAGIC)] != MAGIC:
                raise LogitsFileError(f"{path} does not look like a file of log-probabilities "
                                      f"(saved by --save-logits or llama-perplexity --kl-divergence-base)")
            n_ctx, n_vocab, n_chunk = struct.unpack("<iii", head[len(MAGIC):])
            if n_ctx < 4 or n_vocab < 1 or n_chunk < 1:
                raise LogitsFileError(f"{path}: a broken header (n_ctx {n_ctx}, n_vocab {n_vocab}, n_chunk {n_chunk})")
            header = LogitsHeader(n_ctx, n_vocab, n_chunk)
            expected = header.size_without_trailer()
            if size < expected:
                raise LogitsFileError(f"{path} is truncated: {size} bytes, where {n_chunk} chunks of {n_ctx} "
                                      f"tokens over a vocabulary of {n_vocab} take {expected}")
            self.header = self._with_trailer(f, header, size - expected)
            f.seek(len(MAGIC) + 12)
            self.tokens = np.frombuffer(f.read(4 * n_chunk * n_ctx), dtype="<i4").astype(np.int64).tolist()
        self._rows_offset = len(MAGIC) + 12 + 4 * n_chunk * n_ctx

    def _with_trailer(self, f: BinaryIO, header: LogitsHeader, extra: int) -> LogitsHeader:
        if extra < 12:
            return header
        f.seek(-12, os.SEEK_END)
        length, magic = struct.unpack("<I8s", f.read(12))
        if magic != TRAILER_MAGIC or length + 12 != extra:
            return header
        f.seek(-12 - length, os.SEEK_END)
        try:
            meta = json.loads(f.read(length))
        except ValueError:
            return header
        return LogitsHeader(header.n_ctx, header.n_vocab, header.n_chunk, str(meta.get("model", header.model)),
                            str(meta.get("quantization", "")))

    def log_probs(self, chunk: int) -> np.ndarray:
        """uint16 rows [scored_per_chunk, row_width] of one chunk (a read-only map of the file)."""
        h = self.header
        width = row_width(h.n_vocab)
        offset = self._rows_offset + 2 * chunk * h.scored_per_chunk * width
        return np.memmap(self.path, dtype="<u2", mode="r", offset=offset, shape=(h.scored_per_chunk, width))
