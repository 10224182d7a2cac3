"""Compressed updates with error feedback (issue 35): the codecs and the
worker's residuals, without I/O. `parse("topk:0.01")` gives a codec;
`ErrorFeedback(codec).encode(update)` the tensors to send; `check` and
`decode` are the receiver's side; `Significance` holds back pushes too small
to matter (Gaia's filter)."""

from .codecs import NAMES, Codec, Encoded, check, decode, parse, parse_offer
from .feedback import ErrorFeedback
from .significance import Significance

__all__ = ["NAMES", "Codec", "Encoded", "ErrorFeedback", "Significance", "check", "decode",
           "parse", "parse_offer"]
