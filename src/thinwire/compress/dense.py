"""Identity and half-precision compressors."""

from __future__ import annotations

import torch

from thinwire.compress.base import Compressor, TensorInfo
from thinwire.compress.payload import DensePayload


class Dense(Compressor):
    """Identity: the tensor travels as it is (the DDP baseline)."""

    identity = True

    def compress(self, tensor: torch.Tensor, info: TensorInfo) -> DensePayload:
        return DensePayload(tensor.reshape(-1))


class FP16(Compressor):
    """Casts to float16 for the wire (torch's ``fp16_compress_hook`` in codec form)."""

    def compress(self, tensor: torch.Tensor, info: TensorInfo) -> DensePayload:
        return DensePayload(tensor.reshape(-1).to(torch.float16))
