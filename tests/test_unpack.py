"""The fast unpacking of pack-quantized codes (pipeline/checkpoints/unpack.py) against compressed-tensors' own
`unpack_from_int32`, the peer nobody here wrote: the same int8 codes, bit for bit, for every shape its packer writes,
and the same dense weights when a whole checkpoint loads."""

import pytest
import torch
from compressed_tensors.compressors.pack_quantized import base
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

from pipeline.checkpoints.unpack import fast_unpacking, unpack_codes


@pytest.mark.parametrize("num_bits", [4, 8])
@pytest.mark.parametrize("packed_dim", [0, 1])
@pytest.mark.parametrize("shape", [(64, 576), (7, 33), (1, 8), (3, 1), (2, 5, 40)])
def test_codes_equal_compressed_tensors_own_unpacking(num_bits, packed_dim, shape):
    generator = torch.Generator().manual_seed(sum(shape) + num_bits + packed_dim)
    low, high = -(1 << (num_bits - 1)), (1 << (num_bits - 1))
    codes = torch.randint(low, high, shape, generator=generator, dtype=torch.int8)
    codes.view(-1)[:2] = torch.tensor([low, high - 1], dtype=torch.int8)  # both ends of the range
    packed = pack_to_int32(codes, num_bits, packed_dim=packed_dim)
    theirs = unpack_from_int32(packed, num_bits, torch.Size(shape), packed_dim=packed_dim)
    ours = unpack_codes(packed, num_bits, torch.Size(shape), packed_dim=packed_dim)
    assert ours.dtype == theirs.dtype == torch.int8 and ours.shape == theirs.shape
    assert torch.equal(ours, theirs) and torch.equal(ours, codes)


@pytest.mark.parametrize("packed_dim", [0, 1])
@pytest.mark.parametrize("shape", [(64, 576), (3, 1), (2, 5, 40)])
def test_codes_stay_on_the_device_of_what_was_packed(packed_dim, shape):
    """The codes come back where the packed words were, as compressed-tensors' own: a zero point (packed along dim 0,
    transposed, copied) once came back on the host from a GPU load, and dequantizing every asymmetric W4A16 checkpoint
    on the GPU failed with "cuda:0 and cpu" (H100, 2026-12-06). The meta device stands in for the GPU here (the
    values are checked against compressed-tensors' on the host above; its own function takes no meta tensor)."""
    # contiguous, as a tensor read from a checkpoint is (the packer's own output along dim 0 is a transposed view)
    packed = pack_to_int32(torch.zeros(shape, dtype=torch.int8), 4, packed_dim=packed_dim).contiguous().to("meta")
    ours = unpack_codes(packed, 4, torch.Size(shape), packed_dim=packed_dim)
    assert ours.device == packed.device and ours.shape == shape and ours.dtype == torch.int8


def test_other_widths_keep_compressed_tensors_own_function_and_it_is_put_back():
    original = base.unpack_from_int32
    codes = torch.randint(-4, 4, (5, 70), dtype=torch.int8)
    packed = pack_to_int32(codes, 3)
    with fast_unpacking():
        assert base.unpack_from_int32 is not original
        assert torch.equal(base.unpack_from_int32(packed, 3, torch.Size((5, 70))), codes)  # straddling codes
    assert base.unpack_from_int32 is original


def test_a_w4a16_checkpoint_loads_to_the_same_weights(tiny_variants):
    """A whole AWQ W4A16 checkpoint (4-bit codes and zero points) through load_for_inference, with and without
    the fast path: every tensor the same."""
    from pipeline.checkpoints import loading

    fast = loading.load_for_inference(tiny_variants["awq-w4a16"], torch.float32).state_dict()

    def plain(*args, **kwargs):
        import contextlib
        return contextlib.nullcontext()

    import pipeline.checkpoints.unpack as unpack
    saved = unpack.fast_unpacking
    unpack.fast_unpacking = plain
    try:
        slow = loading.load_for_inference(tiny_variants["awq-w4a16"], torch.float32).state_dict()
    finally:
        unpack.fast_unpacking = saved
    assert fast.keys() == slow.keys()
    assert all(torch.equal(fast[k], slow[k]) for k in fast)
