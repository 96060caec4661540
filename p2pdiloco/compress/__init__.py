"""Delta compression: codecs for outer pseudo-gradients, and learner-side error feedback.

codec = get_codec("int4")                  # or "none", "fp16", "int8"; block_size=...
ef = ErrorFeedback(codec)                  # learner state, one residual per tensor
enc = ef.compress(name, delta)             # Encoded: what goes on the wire
delta_hat = codec.decode(enc)              # syncer side; CodecError on a bad payload
"""

from p2pdiloco.compress.base import Codec, CodecError, Encoded, ErrorFeedback
from p2pdiloco.compress.codecs import CODECS, BlockwiseCodec, Fp16Codec, NoneCodec, get_codec

__all__ = [
    "CODECS",
    "BlockwiseCodec",
    "Codec",
    "CodecError",
    "Encoded",
    "ErrorFeedback",
    "Fp16Codec",
    "NoneCodec",
    "get_codec",
]
