"""Gradient compression codecs and the registry :func:`get_codec`.

=========  ==============================  ========================  ==============
name       payload                         bytes vs float32          reduced by
=========  ==============================  ========================  ==============
none       float32                         100%                      sum
fp16       float16                         50%                       cast-reduce
bf16       bfloat16                        50%                       cast-reduce
int8       int8 codes + f32 scale / block  25.4% (block 256)         gather-decode-sum
topk       f32 values + int32 indices      2% (ratio 0.01)           gather-decode-sum
powersgd   P (n, r), Q (m, r)              r (n + m) / (n m)         powersgd-phases
=========  ==============================  ========================  ==============

Each codec module's docstring gives its error bound and reduction; ``base.py``
the interface; ``reference.py`` / ``cpu.py`` / ``cuda.py`` the array maths.
No communication happens here.
"""

from __future__ import annotations

from .base import Codec
from .cast import Bf16Codec, Fp16Codec
from .error_feedback import ErrorFeedback
from .int8 import Int8Codec
from .none import NoneCodec
from .powersgd import PowerSGDCodec
from .topk import TopKCodec

CODECS = {cls.name: cls for cls in (NoneCodec, Fp16Codec, Bf16Codec, Int8Codec, TopKCodec, PowerSGDCodec)}

__all__ = ["CODECS", "Bf16Codec", "Codec", "ErrorFeedback", "Fp16Codec", "Int8Codec", "NoneCodec",
           "PowerSGDCodec", "TopKCodec", "get_codec"]  # fmt: skip
# Imported only from inside collectives/ (tests/tree/test_surfaces.py): the array maths behind the
# codecs and their wire format; the codec classes are public through the names above.
_INTERNAL = ("cpu", "cuda", "reference", "wire")


def get_codec(name_or_obj="none", *, error_feedback: bool = False, **kwargs) -> Codec:
    """A codec by name, with its options; a Codec object is returned as is.

    Args:
        name_or_obj: one of :data:`CODECS` ("none", "fp16", "bf16", "int8",
            "topk", "powersgd"), or a :class:`Codec`.
        error_feedback: wrap the codec in :class:`ErrorFeedback` (lossy codecs only).
        kwargs: the codec's options, e.g. ``get_codec("int8", block=128)``,
            ``get_codec("topk", ratio=0.001)``, ``get_codec("powersgd", rank=2)``.

    Raises:
        ValueError: unknown name, options given with an object, or error
            feedback asked of a lossless codec.
        TypeError: an option the codec does not take.
    """
    if isinstance(name_or_obj, Codec):
        if kwargs:
            raise ValueError(f"options {sorted(kwargs)} given with a codec object {name_or_obj!r}")
        codec = name_or_obj
    else:
        cls = CODECS.get(name_or_obj)
        if cls is None:
            raise ValueError(f"unknown codec {name_or_obj!r}; known: {', '.join(CODECS)}")
        codec = cls(**kwargs)
    if error_feedback and not isinstance(codec, ErrorFeedback):
        codec = ErrorFeedback(codec)
    return codec
