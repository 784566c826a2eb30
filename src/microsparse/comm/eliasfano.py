"""Offsets inside one range in Elias–Fano form: about 2 + log2(size / count) bits each.

A rank whose positions all lie in one range of ``size`` entries that every rank knows (MiCRO's
owned partition) sends them as offsets into that range. Sorted, each offset splits into its
``low`` bits, l = ⌊log2(size / capacity)⌋ of them, written as they are, and its high part
(offset >> l), written in unary: the i-th smallest offset sets bit high + i of a vector of
capacity + ⌈size / 2**l⌉ bits. An offset then costs l + 1 + 2**-l · size / capacity bits, at
most l + 3: 10.1 where a rank sends 0.35 % of its range, against 16 for an offset inside a
65,536-entry chunk.

The message's size is fixed by ``size`` and ``capacity`` alone, in int32 words (gloo's
all-gather takes no smaller integers): first, packed bit by bit, the low parts' last l % 8
bits and the high parts; then the low parts' other bits, l // 8 whole bytes a slot, so that
neither side takes them apart bit by bit. The decoder finds the i-th set high bit's high part
as its place minus i, from a running count of the bits: nothing is read back to the host when
every rank's count is known.

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

try:
    import numpy
except ModuleNotFoundError:  # the library asks for torch alone: torch.sort everywhere then
    numpy = None

from microsparse.comm.slots import KeptSlots

BYTE_BITS = torch.arange(8, dtype=torch.uint8)
"""A byte's bits, lowest first."""


def position_bits(density: float) -> float:
    """Bits an offset costs where a rank sends ``density`` of its range (the continuous form of
    :class:`EliasFano`'s size, l + 1 + 2**-l / density with l = ⌊log2(1 / density)⌋; it
    grows smoothly as the density falls, 2 + log2(1 / density) at powers of two).

    Example:
        >>> position_bits(1 / 256), round(position_bits(0.0035), 2), position_bits(1.0)
        (10.0, 10.12, 2.0)
    """
    low = max(0, math.floor(math.log2(1.0 / density)))
    return low + 1 + 2.0**-low / density


HOST_SORT = True
"""Sort offsets in host memory with NumPy where it is installed: torch.sort sorts (value,
index) pairs there, six times slower at a few thousand entries (90 µs against 15 at 2,793).
False: torch.sort on every device, the path a GPU runs (what a count of host syncs on the
CPU sets)."""


def _ascending(values: torch.Tensor) -> torch.Tensor:
    """``values`` (int64) in ascending order (NumPy's array shares the tensor's memory)."""
    if HOST_SORT and numpy is not None and values.device.type == "cpu":
        return torch.from_numpy(numpy.sort(values.numpy()))
    return values.sort().values


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
        self._whole, self._rest = divmod(self.low, 8)  # a low part's whole bytes, other bits
        self._packed_bits = capacity * self._rest + self.high_bits
        self._packed_bytes = math.ceil(self._packed_bits / 8)  # where the whole bytes start
        self.words = math.ceil((self._packed_bytes + capacity * self._whole) / 4)
        """int32 words of one rank's message."""
        self._device: torch.device | None = None
        self._offsets = torch.empty(0, 0, dtype=torch.long)
        self._row_starts = torch.empty(0, 1, dtype=torch.long)
        self._kept = KeptSlots()  # slot i of a rank's row at column i + 1

    @property
    def bytes(self) -> int:
        """Bytes of one rank's message."""
        return 4 * self.words

    def encode(self, offsets: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The message (int32, ``words`` long) of ``offsets``: distinct, below ``size``, at most
        ``capacity``, any order; written into ``out`` if given (whose bytes past the code
        stay as they are: zero, where it was made by ``torch.zeros``)."""
        self._constants(offsets.device)
        if out is None:
            out = torch.zeros(self.words, dtype=torch.int32, device=offsets.device)
        message, unpacked = out.view(torch.uint8), self._unpacked
        ordered = _ascending(offsets)
        count, whole, rest, start = ordered.numel(), self._whole, self._rest, self._packed_bytes
        if whole:  # a cast to uint8 keeps a byte's 8 bits
            wholes = message[start : start + count * whole].view(count, whole)
            if whole == 1:  # as for every l from 8 to 15: one shift at most
                wholes.copy_((ordered.bitwise_right_shift(rest) if rest else ordered).view(-1, 1))
            else:
                wholes.copy_(ordered.unsqueeze(1).bitwise_right_shift(self._whole_shifts))
            if count < self.capacity:  # what is not an offset must not leak
                message[start + count * whole : start + self.capacity * whole].zero_()
        unpacked.zero_()
        if rest:  # slot i's bit j at i · rest + j (a bool takes any nonzero as set)
            unpacked[: count * rest].view(count, rest).copy_(
                ordered.unsqueeze(1).bitwise_and(self._rest_masks)
            )
        high = ordered.bitwise_right_shift(self.low).add_(self._high_starts[:count])
        unpacked.index_fill_(0, high, True)
        bits = unpacked.view(torch.uint8).view(-1, 8).mul(self._byte_masks)
        torch.sum(bits, 1, dtype=torch.uint8, out=message[:start])
        return out

    def decode(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Every rank's offsets (int64), rank after rank, each rank's ascending, from the
        gathered ``rows`` (n, ``words`` or more) and every rank's count, known to the host.

        Each row of a table kept from call to call gets slot i at column s = i + 1: first its
        low part less s << l, then, from one 1-D ``scatter_add_`` (deterministic on CUDA too),
        (p + 1) << l from the high bit at place p whose running count is s, the s-th set bit of
        the row: (p + 1 - s) << l is the slot's high part, p minus the set bits before it,
        shifted. An unset bit adds 0 at the column of its running count. A slot past a rank's
        count, as where every rank is answered this rank's message (``SymmetricPeers``'
        timings), has no set bit: it reads below 2**l, negative where its low bits are 0 (the
        caller keeps offsets inside the ranges)."""
        n, device = rows.shape[0], rows.device
        if sum(counts) == 0:
            return torch.empty(0, dtype=torch.long, device=device)
        self._constants(device)
        message = rows.reshape(n, -1).view(torch.uint8)
        bits, table = self._unpack(message), self._table(n, device)
        self._write_lows(message, bits, table[:, 1:])
        high = bits[:, self.capacity * self._rest : self._packed_bits]
        at = high.cumsum(1, dtype=torch.long)  # s
        placed = torch.mul(self._placed, high)  # (p + 1) << l where set, else 0
        at.add_(self._row_starts)
        table.view(-1).scatter_add_(0, at.view(-1), placed.view(-1))
        keep = self._kept.index(counts, self.capacity + 1, first=1, device=device)
        return table.view(-1).index_select(0, keep)

    def _write_lows(self, message: torch.Tensor, bits: torch.Tensor, lows: torch.Tensor) -> None:
        """Slot i's low part less (i + 1) << l, of every rank, into ``lows`` (n, capacity):
        from its whole bytes (one ``addcmul`` where there is one, as for every l from 8 to 15)
        and its last l % 8 bits."""
        n, capacity, whole, rest = lows.shape[0], self.capacity, self._whole, self._rest
        if whole:
            start = self._packed_bytes
            parts = message[:, start : start + capacity * whole].view(n, capacity, whole)
            if whole == 1:
                torch.addcmul(self._less, parts.squeeze(2), self._whole_weights, out=lows)
            else:
                torch.sum(parts.mul(self._whole_weights), 2, out=lows).add_(self._less)
        if rest == 1 and whole:  # as for l = 9: the bit itself
            lows.add_(bits[:, :capacity])
        elif rest:
            parts = bits[:, : capacity * rest].view(n, capacity, rest).mul(self._rest_masks)
            if whole:
                lows.add_(parts.sum(2))
            else:
                torch.sum(parts, 2, out=lows).add_(self._less)
        if not self.low:
            lows.copy_(self._less)

    def counts(self, rows: torch.Tensor) -> list[int]:
        """Every rank's count (its set high bits), read on the host (one read back)."""
        self._constants(rows.device)
        bits = self._unpack(rows.reshape(rows.shape[0], -1).view(torch.uint8))
        return bits[:, self.capacity * self._rest : self._packed_bits].sum(1).tolist()

    def _unpack(self, message: torch.Tensor) -> torch.Tensor:
        """(n, packed bits) int64 of 0 and 1: every bit packed bit by bit, of every rank, each
        byte's 8 looked up in a table of 256 rows."""
        packed = message[:, : self._packed_bytes].long()
        return self._byte_bits.index_select(0, packed.view(-1)).view(packed.shape[0], -1)

    def _constants(self, device: torch.device) -> None:
        """The encoder's bool per packed bit, and the constants both sides use, on ``device``."""
        if self._device == device:
            return
        self._device = device
        capacity, whole, rest = self.capacity, self._whole, self._rest
        self._unpacked = torch.zeros(8 * self._packed_bytes, dtype=torch.bool, device=device)
        every_byte = torch.arange(256, device=device).unsqueeze(1)  # row b: b's 8 bits
        self._byte_bits = every_byte.bitwise_right_shift(torch.arange(8, device=device)) & 1
        bytes_ = torch.arange(whole, device=device).mul_(8).add_(rest)  # bit of each byte
        self._whole_shifts = bytes_
        self._whole_weights = torch.ones_like(bytes_).bitwise_left_shift_(bytes_)
        self._rest_masks = torch.ones(rest, dtype=torch.long, device=device)
        self._rest_masks.bitwise_left_shift_(torch.arange(rest, device=device))
        self._byte_masks = torch.ones(8, dtype=torch.uint8, device=device)
        self._byte_masks.bitwise_left_shift_(BYTE_BITS.to(device))
        rests = capacity * rest  # the high parts follow the low parts' last bits
        self._high_starts = torch.arange(rests, rests + capacity, device=device)
        self._placed = torch.arange(1, self.high_bits + 1, device=device) << self.low
        self._less = torch.arange(1, capacity + 1, device=device).mul_(-1 << self.low)

    def _table(self, n: int, device: torch.device) -> torch.Tensor:
        """(n, capacity + 1) offsets, kept from call to call: column 0 stays 0 (it takes the
        zeros of the unset bits before a row's first set one), slot i is column i + 1; and
        where each row starts, flattened."""
        width = self.capacity + 1
        if self._offsets.shape[0] != n or self._offsets.device != device:
            self._offsets = torch.zeros(n, width, dtype=torch.long, device=device)
            self._row_starts = torch.arange(0, n * width, width, device=device).unsqueeze(1)
        return self._offsets
