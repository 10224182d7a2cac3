"""The parameter server's apply step, as ParameterStore runs it: a whole
update (validate, finiteness, momentum step) and a staged one (computed
while its bytes arrive, committed at the end), for a 64 MiB and a 2.5 MB
model, against the bare kernel (momentum_apply in place: the floor).

Run it under two checkouts to compare them (alternate the runs and take
medians; PYTHONPATH picks the tree):

    PYTHONPATH=. python benchmarks/bench_store.py [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from mlfabric import _core
from mlfabric.protocol import layout
from mlfabric.store import ParameterStore

SIZES = {"64 MiB": 16 << 20, "2.5 MB": 640_000}


def run(elements: int, repeats: int) -> dict[str, float]:
    rng = np.random.default_rng(0)
    model = {"w": rng.standard_normal(elements, dtype=np.float32)}
    store = ParameterStore(model, momentum=0.9)
    update = {"w": (rng.standard_normal(elements, dtype=np.float32) * np.float32(1e-3))}
    specs = store.specs
    offsets, nbytes = layout(specs)
    data = memoryview(update["w"].view(np.uint8))
    w, prev = model["w"].copy(), model["w"].copy()
    out: dict[str, list[float]] = {"apply": [], "staged": [], "kernel": []}
    for _ in range(repeats):
        t = time.perf_counter()
        store.apply(store.version, update)
        out["apply"].append(time.perf_counter() - t)
        t = time.perf_counter()
        staged = store.begin_staged(store.version, specs, offsets)
        assert staged is not None
        staged.feed(data, nbytes)
        assert staged.finish(data) is not None
        out["staged"].append(time.perf_counter() - t)
        t = time.perf_counter()
        _core.momentum_apply(w, prev, update["w"], 0.9)
        out["kernel"].append(time.perf_counter() - t)
    return {k: statistics.median(v) * 1e3 for k, v in out.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args()
    for name, n in SIZES.items():
        r = run(n, args.repeats)
        print(f"{name}: apply {r['apply']:.3f} ms, staged {r['staged']:.3f} ms, "
              f"kernel {r['kernel']:.3f} ms; apply / kernel {r['apply'] / r['kernel']:.2f}x")


if __name__ == "__main__":
    main()
