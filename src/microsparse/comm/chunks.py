"""Positions inside one range as 16-bit words: a count per chunk, then each offset's low bits.

A rank whose positions all lie in one range of ``size`` entries that every rank knows (MiCRO's
owned partition) sends them as offsets into that range, sorted. The range is cut into chunks
of ``span`` entries (65,536, or 32,768 where one chunk could hold 65,536 picks, so that every
count fits in 16 bits); the message is the count of picks in each chunk, then each offset's
low bits (its offset within its chunk), 16 bits each, zero-padded to whole 32-bit words
because gloo's all-gather takes no 16-bit integers. The decoder finds each offset's chunk
from the running counts, at sizes known in advance: nothing is read back.

Example:
    >>> codec = ChunkCodec(chunks=2, span=8, capacity=4)
    >>> message = codec.encode(torch.tensor([9, 1, 14, 3]))    # chunk 0: 1, 3; chunk 1: 9, 14
    >>> message.view(torch.int16).tolist()                      # counts, low bits, padding
    [2, 2, 1, 3, 1, 6]
    >>> codec.decode(message.unsqueeze(0), [4]).tolist()
    [1, 3, 9, 14]
"""

from __future__ import annotations

import math

import torch

SPAN = 1 << 16
"""Entries per chunk: an offset's low 16 bits."""


def chunk_span(capacity: int) -> int:
    """Entries per chunk for messages of ``capacity`` offsets: 2**16, unless a chunk could then
    hold 2**16 picks (a count of 65,536 needs 17 bits): 2**15.

    Example:
        >>> chunk_span(1000), chunk_span(70_000)
        (65536, 32768)
    """
    return SPAN if capacity < SPAN else SPAN // 2


class ChunkCodec:
    """Encodes up to ``capacity`` distinct offsets below ``chunks · span`` into one fixed-size
    int32 message, and decodes every rank's message (see the module docstring)."""

    def __init__(self, chunks: int, span: int, capacity: int) -> None:
        if span & (span - 1) or not 0 < span <= SPAN or min(capacity, span) >= SPAN:
            raise ValueError(
                f"chunks of {span} entries with up to {capacity} offsets do not fit 16 bits: "
                "the span must be a power of 2 up to 65,536 whose counts stay below 65,536 "
                "(chunk_span(capacity) gives one)"
            )
        self.chunks, self.span, self.capacity = chunks, span, capacity
        self.shift = span.bit_length() - 1
        self.halfwords = chunks + capacity
        """16-bit words that carry something: the counts, then the offsets."""
        self.words = math.ceil(self.halfwords / 2)
        """int32 words of the message (the last one half padding when ``halfwords`` is odd)."""
        self._bounds = torch.empty(0, dtype=torch.long)
        self._mark_rows = torch.empty(0, 0, dtype=torch.long)
        self._row_starts = torch.empty(0, 1, dtype=torch.long)
        self._one_per_chunk = torch.empty(0, dtype=torch.long)
        self._known: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}

    @property
    def bytes(self) -> int:
        """Bytes of one rank's message."""
        return 4 * self.words

    def encode(self, offsets: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The message (int32, ``words`` long) of ``offsets``: distinct, below
        ``chunks · span``, at most ``capacity``, any order; written into ``out`` if given."""
        device = offsets.device
        if out is None:
            out = torch.empty(self.words, dtype=torch.int32, device=device)
        half = out.view(torch.int16)
        sorted_offsets = offsets.sort().values
        count = sorted_offsets.numel()
        bounds = self._chunk_bounds(device)
        ends = torch.searchsorted(sorted_offsets, bounds)  # picks below each chunk's start
        # Written straight into the message (int64 results kept to their low 16 bits): a
        # count is at most 65,535 (or 32,768), exact; an offset's low bits, as decode reads.
        counts, low = half[: self.chunks], half[self.chunks : self.chunks + count]
        torch.sub(ends[1:], ends[:-1], out=counts)
        torch.bitwise_and(sorted_offsets, self.span - 1, out=low)
        if self.chunks + count < half.numel():  # what is not an offset must not leak
            half[self.chunks + count :] = 0
        return out

    def decode(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Every rank's offsets (int64), rank after rank, each rank's ascending, from the
        gathered ``rows`` (n, ``words``) and every rank's count, known to the host.

        Slot j of a rank's offsets lies in chunk c = the number of chunk ends (running counts)
        at or below j: a mark at each end, summed along the slots (one scan, at sizes fixed in
        advance, where a binary search per slot costs five times as much on the CPU). A slot
        past the rank's count, as where every rank is answered this rank's message
        (``SymmetricPeers``' timings), reads as an offset past the last chunk, which the caller
        keeps inside the rank's range."""
        n = rows.shape[0]
        half = rows.view(torch.int16)
        if sum(counts) == 0:
            return torch.empty(0, dtype=torch.long, device=rows.device)
        # Every 16-bit word read as unsigned, in one pass: the counts, then the low bits.
        words = half[:, : self.chunks + self.capacity].long().bitwise_and_(0xFFFF)
        ends = words[:, : self.chunks].cumsum(1)
        marks, row_starts, ones = self._marks(n, rows.device)
        # one flat row of n · (capacity + 1) counters: a 1-D scatter_add_ is deterministic on
        # CUDA too (torch.use_deterministic_algorithms), where a 2-D one may refuse to run
        at = ends.clamp_(max=self.capacity).add_(row_starts).view(-1)
        marks.zero_().view(-1).scatter_add_(0, at, ones)
        chunk = marks[:, : self.capacity].cumsum(1)
        words[:, self.chunks :].add_(chunk, alpha=self.span)  # offset: chunk · span + low bits
        return words.view(-1).index_select(0, self._keep(counts, rows.device))

    def counts(self, rows: torch.Tensor) -> list[int]:
        """Every rank's count, read from the gathered headers on the host (one read back)."""
        half = rows.view(torch.int16)  # (n, 2 · words), or more where a guard follows
        return half[:, : self.chunks].long().bitwise_and_(0xFFFF).sum(1).tolist()

    def _chunk_bounds(self, device: torch.device) -> torch.Tensor:
        if self._bounds.numel() != self.chunks + 1 or self._bounds.device != device:
            self._bounds = torch.arange(0, self.chunks + 1, device=device) << self.shift
        return self._bounds

    def _marks(self, n: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(n, capacity + 1) counters of chunk ends per slot (column ``capacity`` takes the
        ends at or past the last slot), where each rank's row starts in them flattened, and
        the n · chunks ones added at the ends."""
        width = self.capacity + 1
        if self._mark_rows.shape != (n, width) or self._mark_rows.device != device:
            self._mark_rows = torch.empty(n, width, dtype=torch.long, device=device)
            self._row_starts = torch.arange(0, n * width, width, device=device).unsqueeze(1)
            self._one_per_chunk = torch.ones(n * self.chunks, dtype=torch.long, device=device)
        return self._mark_rows, self._row_starts, self._one_per_chunk

    def _keep(self, counts: list[int], device: torch.device) -> torch.Tensor:
        """Where each rank's offsets lie in its row of words (its chunk counts first),
        flattened: made once per pattern of counts (they rotate with the step: a few per
        rank)."""
        key = (tuple(counts), device)
        keep = self._known.get(key)
        if keep is None:
            if len(self._known) > 4 * len(counts):
                self._known.clear()
            width = self.chunks + self.capacity
            slots = [r * width + self.chunks + i for r, count in enumerate(counts)
                     for i in range(count)]  # fmt: skip
            keep = self._known[key] = torch.tensor(slots, dtype=torch.long, device=device)
        return keep
