"""`specserve bench spec` with the EAGLE head's projections (and, with `all`, its LM-head readout)
kept in float32 instead of the int8 / Q8_0 kernels serving picks on a CPU: how much of the served
accepted length the head's quantization costs.

    python benchmarks/eagle_head_float32.py all bench spec --model M --methods eagle:fixed@4 --eagle-head DIR ...
"""

from __future__ import annotations

import sys
from typing import Any


def main() -> int:
    import specserve.model.quant as quant
    from specserve.model.eagle import EagleHead

    mode, argv = sys.argv[1], sys.argv[2:]
    if mode not in ("head", "all"):
        raise SystemExit("usage: eagle_head_float32.py head|all bench spec ...")
    real = quant.prepare_linears

    def float32_head(model: Any, precision: str, choose: Any, int4_source: Any = None, more: Any = None) -> Any:
        if isinstance(model, EagleHead) or (mode == "all" and type(model).__name__ == "Linear"):
            return real(model, "none", choose)
        return real(model, precision, choose, int4_source, more)

    quant.prepare_linears = float32_head  # the drafter factory imports it at build time
    from specserve.cli import main as cli

    return cli(argv)


if __name__ == "__main__":
    sys.exit(main())
