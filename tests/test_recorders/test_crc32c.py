import random

import pytest
from tensorboard.compat.tensorflow_stub import pywrap_tensorflow as reference

from trainer.recorders.crc32c import crc32c, masked_crc32c

# Around the per-byte/numpy switch (32), the 4-byte register fold, and the 1024-byte chunks
# (a last chunk of 1, 3, 4 and 5 bytes).
_EDGE_LENGTHS = [0, 1, 3, 4, 5, 31, 32, 33, 36, 1023, 1024, 1025, 1027, 1028, 1029, 2048, 5000]
_RANDOM_LENGTHS = random.Random(0).sample(range(6000), 40)


def test_check_value():
    assert crc32c(b"123456789") == 0xE3069283


@pytest.mark.parametrize("length", _EDGE_LENGTHS + _RANDOM_LENGTHS)
def test_matches_tensorboards_pure_python_crc(length):
    data = random.Random(length).randbytes(length)
    assert crc32c(data) == reference.crc32c(data)
    assert masked_crc32c(data) == reference.masked_crc32c(data)


@pytest.mark.parametrize("fill", [0x00, 0xFF])
def test_uniform_bytes(fill):
    # All-zero data makes a wrongly folded starting register obvious.
    data = bytes([fill]) * 3000
    assert crc32c(data) == reference.crc32c(data)

