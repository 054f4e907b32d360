"""Pure tensor maths: tensor (+ state) -> payload -> tensor. No collectives.

Floor: the lowest; it imports no other part of thinwire.
"""

from thinwire.compress.base import Compressor, TensorInfo, decode, keep_count
from thinwire.compress.dense import FP16, Dense
from thinwire.compress.payload import DensePayload, LowRankPayload, Payload, SparsePayload
from thinwire.compress.sparse import DCTThreshold, LaplaceThreshold, Sparsifier, TopK

__all__ = [
    "FP16",
    "Compressor",
    "DCTThreshold",
    "Dense",
    "DensePayload",
    "LaplaceThreshold",
    "LowRankPayload",
    "Payload",
    "SparsePayload",
    "Sparsifier",
    "TensorInfo",
    "TopK",
    "decode",
    "keep_count",
]
