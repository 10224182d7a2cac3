"""An update as it went on the wire compressed (issue 35)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np


class CompressedParts(dict[str, np.ndarray]):
    """A compressed update's parts by NAME#PART, with its `codecs` (the
    push's field). The client encodes an update once, when it first leaves;
    wherever it goes again (to the replica, numbered with the server's
    version, or to the promoted replica after a failover) these same parts
    go: encoding again would send the residual twice, and a replica must
    decode the very bits its server decoded."""

    def __init__(self, parts: Mapping[str, np.ndarray],
                 codecs: tuple[tuple[str, str], ...]) -> None:
        super().__init__(parts)
        self.codecs = codecs
