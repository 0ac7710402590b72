"""compressed-tensors' pack-quantized codes, unpacked fast at load.

A W4A16 checkpoint (compressed-tensors `pack-quantized`: eight 4-bit codes per int32, the first in the lowest bits)
is decompressed at every load for the in-process engines (`loading.load_for_inference`): in the demo's DAG, ten
loads of W4A16 checkpoints (verify, rank, fix, KL, judge, evaluate). compressed-tensors' `unpack_from_int32`
serves every width from 1 to 8 bits, codes that straddle two words included, through a gather of every code's word;
it was most of a load's time. For 4 and 8 bits no code straddles a byte: on a little-endian machine the codes are
the words' bytes in memory order, split into nibbles for 4 bits. `fast_unpacking()` hands compressed-tensors'
decompressor that path for 4- and 8-bit codes and its own function for any other width; the int8 codes are the same,
bit for bit (tests/test_unpack.py checks them against compressed-tensors' own, on random codes of every shape the
packer writes and on whole checkpoints).
"""

from __future__ import annotations

import contextlib
import sys

FAST_BITS = (4, 8)  # widths whose codes never straddle a byte


def unpack_codes(value, num_bits: int, shape, packed_dim: int = 1):
    """compressed_tensors' `unpack_from_int32(value, num_bits, shape, packed_dim)` for 4- and 8-bit codes on a
    little-endian machine: int8 codes, offset by -2^(bits-1) as the packer offset them by +2^(bits-1)."""
    import torch

    if value.ndim > 2:  # stacked (MoE experts): each 2-D slice, as compressed-tensors does
        return torch.stack([unpack_codes(value[i], num_bits, shape[1:], packed_dim) for i in range(value.shape[0])])
    if packed_dim == 0:
        value = value.transpose(0, 1)
    if value.stride(-1) != 1 or not value.is_contiguous():  # (a size-1 dimension can leave a stride that view refuses)
        # on the value's own device: a zero point (packed along dim 0) copied to the host broke the dequantization
        # of every asymmetric W4A16 checkpoint loaded onto a GPU (H100, 2026-12-06: cuda:0 and cpu)
        value = torch.empty(value.shape, dtype=value.dtype, device=value.device).copy_(value)
    rows, cols = value.shape[0], int(shape[packed_dim])
    data = value.view(torch.uint8)  # (rows, words x 4), bytes in memory order: the lowest bits first
    if num_bits == 4:
        data = torch.stack((data & 0xF, data >> 4), dim=-1).reshape(rows, -1)
    codes = data[:, :cols].to(torch.int16) - (1 << (num_bits - 1))
    if packed_dim == 0:
        codes = codes.transpose(0, 1)
    return codes.to(torch.int8)


@contextlib.contextmanager
def fast_unpacking():
    """While inside, compressed-tensors' pack-quantized decompressor unpacks 4- and 8-bit codes with `unpack_codes`
    (any other width, or a big-endian machine, with its own function); put back on the way out."""
    try:
        from compressed_tensors.compressors.pack_quantized import base
    except ImportError:  # a compressed-tensors without this module: nothing to speed up
        yield
        return
    original = getattr(base, "unpack_from_int32", None)
    if original is None or sys.byteorder != "little":
        yield
        return

    def unpack(value, num_bits, shape, packed_dim=1):
        import torch

        if num_bits in FAST_BITS and value.dtype is torch.int32:
            return unpack_codes(value, num_bits, shape, packed_dim)
        return original(value, num_bits, shape, packed_dim)

    base.unpack_from_int32 = unpack
    try:
        yield
    finally:
        base.unpack_from_int32 = original
