"""Pure tensor maths: selections, value codecs, index codecs and payload layouts. No collectives.

Floor: the lowest; it imports no other part of thinwire.
"""

from thinwire.compress.base import TensorInfo, keep_count
from thinwire.compress.payload import (
    DensePayload,
    IndexCodec,
    LowRankPayload,
    Payload,
    SparseLayout,
    SparsePayload,
    decode,
)
from thinwire.compress.sparse import DCTThreshold, LaplaceThreshold, Sparsifier, TopK
from thinwire.compress.values import (
    FULL_WIDTH,
    Binned,
    Cast,
    Quantised,
    ValueCodec,
    value_codec,
)

__all__ = [
    "FULL_WIDTH",
    "Binned",
    "Cast",
    "DCTThreshold",
    "DensePayload",
    "IndexCodec",
    "LaplaceThreshold",
    "LowRankPayload",
    "Payload",
    "Quantised",
    "SparseLayout",
    "SparsePayload",
    "Sparsifier",
    "TensorInfo",
    "TopK",
    "ValueCodec",
    "decode",
    "keep_count",
    "value_codec",
]
