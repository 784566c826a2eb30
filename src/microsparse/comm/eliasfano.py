"""Offsets inside one range in Elias–Fano form: about 2 + log2(size / count) bits each.

A rank whose positions all lie in one range of ``size`` entries that every rank knows (MiCRO's
owned partition) sends them as offsets into that range. Sorted, each offset splits into its
``low`` bits, l = ⌊log2(size / capacity)⌋ of them, written as they are, and its high part
(offset >> l), written in unary: the i-th smallest offset sets bit high + i of a vector of
capacity + ⌈size / 2**l⌉ bits. An offset then costs l + 1 + 2**-l · size / capacity bits, at
most l + 3: 10.5 where a rank sends 0.27 % of its range, against 16 for an offset inside a
65,536-entry chunk. The message's size is fixed by ``size`` and ``capacity`` alone (bits
packed into int32 words, as gloo's all-gather takes no smaller integers), and the decoder
finds the i-th set bit's high part as its place minus i, from a running count of the bits:
nothing is read back to the host when every rank's count is known.

Example:
    >>> codec = EliasFano(size=64, capacity=4)     # 4 · 4 low bits, 4 + 63 >> 4 high bits
    >>> codec.bits, codec.words
    (23, 1)
    >>> message = codec.encode(torch.tensor([37, 2, 40, 9]))
    >>> codec.decode(message.unsqueeze(0), [4]).tolist()
    [2, 9, 37, 40]
"""

from __future__ import annotations

import math

import torch

BYTE_BITS = torch.arange(8, dtype=torch.uint8)
"""Shifts that take a byte's bits apart, lowest first."""


def position_bits(density: float) -> float:
    """Bits an offset costs where a rank sends ``density`` of its range (the continuous form of
    :class:`EliasFano`'s size, l + 1 + 2**-l / density with l = ⌊log2(1 / density)⌋; it
    grows smoothly as the density falls, 2 + log2(1 / density) at powers of two).

    Example:
        >>> position_bits(1 / 256), round(position_bits(0.00267), 2), position_bits(1.0)
        (10.0, 10.46, 2.0)
    """
    low = max(0, math.floor(math.log2(1.0 / density)))
    return low + 1 + 2.0**-low / density


class EliasFano:
    """Encodes up to ``capacity`` distinct offsets below ``size`` into one fixed-size int32
    message, and decodes every rank's message (see the module docstring)."""

    def __init__(self, size: int, capacity: int) -> None:
        if size < 1 or capacity < 1:
            raise ValueError(f"a range of {size} entries and a capacity of {capacity} offsets: "
                             "both must be >= 1")  # fmt: skip
        self.size, self.capacity = size, capacity
        self.low = max(0, (size // capacity).bit_length() - 1)
        self.high_bits = ((size - 1) >> self.low) + capacity
        self.bits = capacity * self.low + self.high_bits
        """Bits of the code: the low parts, then the unary high parts."""
        self.words = math.ceil(self.bits / 32)
        """int32 words of one rank's message."""
        self._low_shifts = self._low_weights = torch.empty(0, dtype=torch.long)
        self._byte_shifts = self._byte_weights = torch.empty(0, dtype=torch.uint8)
        self._places = torch.empty(0, dtype=torch.long)
        self._unpacked = torch.empty(0, dtype=torch.uint8)
        self._slots = torch.empty(0, dtype=torch.long)
        self._row_starts = torch.empty(0, 1, dtype=torch.long)
        self._known: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}

    @property
    def bytes(self) -> int:
        """Bytes of one rank's message."""
        return 4 * self.words

    def encode(self, offsets: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The message (int32, ``words`` long) of ``offsets``: distinct, below ``size``, at most
        ``capacity``, any order; written into ``out`` if given."""
        device = offsets.device
        if out is None:
            out = torch.empty(self.words, dtype=torch.int32, device=device)
        unpacked = self._buffers(device)
        unpacked.zero_()
        ordered = offsets.sort().values
        count = ordered.numel()
        low, lows = self.low, self.capacity * self.low
        if low:  # slot i's bit j at i · l + j
            bits = ordered.unsqueeze(1).bitwise_right_shift(self._low_shifts)
            unpacked[: count * low].copy_(bits.bitwise_and_(1).view(-1))
        high = ordered.bitwise_right_shift(low).add_(self._places[lows : lows + count])
        unpacked.index_fill_(0, high, 1)  # place lows + i: the low parts come first
        packed = out.view(torch.uint8)
        torch.sum(unpacked.view(-1, 8).mul_(self._byte_weights), 1, dtype=torch.uint8, out=packed)
        return out

    def decode(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Every rank's offsets (int64), rank after rank, each rank's ascending, from the
        gathered ``rows`` (n, ``words`` or more) and every rank's count, known to the host.

        A set bit's slot is the number of set bits before it, so one running count places
        every high part (a 1-D ``scatter_add_``, deterministic on CUDA too, into a row with one
        column more that takes the unset bits' zeros). A slot past a rank's count, as where
        every rank is answered this rank's message (``SymmetricPeers``' timings), reads as
        offset 0, inside every range."""
        n, device = rows.shape[0], rows.device
        if sum(counts) == 0:
            return torch.empty(0, dtype=torch.long, device=device)
        self._buffers(device)
        bits = self._unpack(rows)
        low, lows, width = self.low, self.capacity * self.low, self.capacity + 1
        high = bits[:, lows : self.bits].long()
        slot = high.cumsum(1)  # slot + 1 at a set bit
        places = high.mul(self._places[: self.high_bits].add(1)).sub_(slot.mul(high))
        at = slot.sub_(1 + self.capacity).mul_(high).add_(self._slot_rows(n, device))
        table = torch.zeros(n * width, dtype=torch.long, device=device)
        table.scatter_add_(0, at.view(-1), places.view(-1))  # ... where the bit is set, else 0
        offsets = table.view(n, width)[:, : self.capacity].bitwise_left_shift_(low)
        if low:
            parts = bits[:, :lows].view(n, self.capacity, low).long().mul_(self._low_weights)
            offsets.bitwise_or_(parts.sum(2))
        return table.index_select(0, self._keep(counts, device))

    def counts(self, rows: torch.Tensor) -> list[int]:
        """Every rank's count (its set high bits), read on the host (one read back)."""
        self._buffers(rows.device)
        return self._unpack(rows)[:, self.capacity * self.low : self.bits].sum(1).tolist()

    def _unpack(self, rows: torch.Tensor) -> torch.Tensor:
        """(n, 8 · message bytes) of 0/1 bytes: every bit of every rank's message."""
        n = rows.shape[0]
        packed = rows.reshape(n, -1)[:, : self.words].contiguous().view(torch.uint8)
        bits = packed.unsqueeze(2).bitwise_right_shift(self._byte_shifts)
        return bits.bitwise_and_(1).view(n, -1)

    def _buffers(self, device: torch.device) -> torch.Tensor:
        """The encoder's 0/1 byte per bit of the message, and the constants both sides use."""
        if self._unpacked.device != device or self._unpacked.numel() != 32 * self.words:
            self._unpacked = torch.zeros(32 * self.words, dtype=torch.uint8, device=device)
            self._places = torch.arange(32 * self.words, device=device)
            self._low_shifts = torch.arange(self.low, device=device)
            self._low_weights = torch.ones_like(self._low_shifts).bitwise_left_shift_(
                self._low_shifts
            )
            self._byte_shifts = BYTE_BITS.to(device)
            self._byte_weights = torch.ones_like(self._byte_shifts).bitwise_left_shift_(
                self._byte_shifts
            )
        return self._unpacked

    def _slot_rows(self, n: int, device: torch.device) -> torch.Tensor:
        """Where each rank's row of ``capacity + 1`` slots ends, flattened, less one: a bit's
        slot less ``capacity + 1``, plus this, lands in its rank's row (an unset bit, made
        zero, at the row's last column)."""
        width = self.capacity + 1
        if self._row_starts.shape[0] != n or self._row_starts.device != device:
            self._row_starts = torch.arange(width, (n + 1) * width, width, device=device)
            self._row_starts = self._row_starts.sub_(1).unsqueeze(1)
        return self._row_starts

    def _keep(self, counts: list[int], device: torch.device) -> torch.Tensor:
        """Where each rank's offsets lie in the (n, capacity + 1) table, flattened: made once
        per pattern of counts (they rotate with the step: a few per rank)."""
        key = (tuple(counts), device)
        keep = self._known.get(key)
        if keep is None:
            if len(self._known) > 4 * len(counts):
                self._known.clear()
            width = self.capacity + 1
            slots = [r * width + i for r, count in enumerate(counts)
                     for i in range(count)]  # fmt: skip
            keep = self._known[key] = torch.tensor(slots, dtype=torch.long, device=device)
        return keep
