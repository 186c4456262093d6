"""Bucketing of small reduce-scatters into fewer large ones (FSDP's gradient reduction).

    bucketer = ReduceScatterBucketer(bucket_cap_mb=25)
    bucketer.reduce_scatter_async(small, group, callback_fn=on_small)   # queued in a bucket
    bucketer.reduce_scatter_async(big, group, callback_fn=on_big)       # too big: reduced now
    bucketer.flush()                                                    # on_small runs here

A bucket is a ``(world_size, shard)`` buffer per (dtype, device, group): input ``i`` of each call
goes to row ``i`` at the bucket's current offset, so one reduce-scatter of the whole buffer gives
every rank the sum of its row for all queued calls at once; callbacks then see their slice of
the output. ``bucket_cap_mb`` is the whole bucket's size (each row gets 1/world_size of it);
inputs larger than a row, or any input when ``bucket_cap_mb <= 0``, are reduced immediately.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["ReduceScatterBucketer", "Bucket"]


def _reduce_scatter(out: torch.Tensor, rows: torch.Tensor, group: Any) -> None:
    """Sum ``rows`` (world_size, k) over the group; this rank keeps row ``rank`` in ``out`` (k,)."""
    dist.reduce_scatter_single(out, rows.reshape(-1).contiguous(), group=group)


class Bucket:
    """One (world_size, shard) staging buffer, its fill offset and the callbacks waiting on it."""

    def __init__(self, data: torch.Tensor, group: Any) -> None:
        self.data = data
        self.group = group
        self.offset = 0
        self.callbacks: list[Callable[[], None]] = []
        self.output_shard = torch.zeros_like(data[0])

    def flush(self) -> None:
        """Reduce-scatter what is queued, run its callbacks, and start a fresh output shard."""
        if self.offset == 0:
            assert not self.callbacks, "bucket has callbacks but no data"
            return
        _reduce_scatter(self.output_shard[:self.offset], self.data[:, :self.offset], self.group)
        for fn in self.callbacks:
            fn()
        self.data[:, :self.offset].zero_()
        self.offset = 0
        self.callbacks.clear()
        # callbacks may keep views of the old output: never overwrite it
        self.output_shard = torch.zeros_like(self.data[0])

    def setup(self) -> None:
        """(Re)allocate the buffers after :meth:`teardown` (they are freed between backward passes)."""
        for t in (self.data, self.output_shard):
            if t.untyped_storage().size() == 0:
                t.untyped_storage().resize_(t.numel() * t.element_size())

    def teardown(self) -> None:
        """Free the buffers' memory (keeping the tensors, so :meth:`setup` can restore them)."""
        assert self.offset == 0 and not self.callbacks, "teardown of a bucket with queued data; flush() first"
        for t in (self.data, self.output_shard):
            t.untyped_storage().resize_(0)


class ReduceScatterBucketer:
    """Queue reduce-scatters of small tensors into shared buckets (see the module docstring).

    Args:
        bucket_cap_mb: bucket size in MiB for all ranks' rows together; ``<= 0`` disables bucketing.
    """

    def __init__(self, bucket_cap_mb: float = 25) -> None:
        self.bucket_cap_mb = bucket_cap_mb
        self.buckets: dict[tuple[torch.dtype, torch.device, Any], Bucket] = {}

    @torch.no_grad()
    def reduce_scatter_async(self, input_list: list[torch.Tensor], group: Any,
                             callback_fn: Callable[[torch.Tensor], Any] | None = None) -> None:
        """Reduce-scatter ``input_list`` (one equal-shaped tensor per rank of ``group``) now or at the
        next :meth:`flush`; ``callback_fn`` gets this rank's summed tensor, shaped like the inputs."""
        world_size = group.size()
        if len(input_list) != world_size:
            raise AssertionError(f"reduce_scatter received {len(input_list)} inputs, expected group.size() "
                                 f"({world_size})")
        first = input_list[0]
        n = first.numel()
        if n > self._shard_size(first.element_size(), world_size):
            out = torch.zeros_like(first)
            _reduce_scatter(out.view(-1), torch.stack([t.reshape(-1) for t in input_list]), group)
            if callback_fn is not None:
                callback_fn(out)
            return
        bucket = self._bucket(first, group)
        if n > bucket.data.size(1) - bucket.offset:
            bucket.flush()
        offset = bucket.offset
        bucket.data[:, offset:offset + n].copy_(torch.stack([t.reshape(-1) for t in input_list]))
        bucket.offset += n
        if callback_fn is not None:
            result = bucket.output_shard[offset:offset + n].view_as(first)
            bucket.callbacks.append(functools.partial(callback_fn, result))

    @torch.no_grad()
    def flush(self) -> None:
        """Reduce-scatter every partly filled bucket and run its callbacks."""
        for bucket in self.buckets.values():
            bucket.flush()

    @torch.no_grad()
    def teardown(self) -> None:
        """Free every bucket's memory (after :meth:`flush`)."""
        for bucket in self.buckets.values():
            bucket.teardown()

    def _shard_size(self, element_size: int, world_size: int) -> int:
        if self.bucket_cap_mb <= 0:
            return 0
        return int(self.bucket_cap_mb * 1024 * 1024 / element_size // world_size)

    def _bucket(self, tensor: torch.Tensor, group: Any) -> Bucket:
        key = (tensor.dtype, tensor.device, group)
        if key not in self.buckets:
            rows = tensor.new_zeros((group.size(), self._shard_size(tensor.element_size(), group.size())))
            self.buckets[key] = Bucket(rows, group)
        self.buckets[key].setup()
        return self.buckets[key]
