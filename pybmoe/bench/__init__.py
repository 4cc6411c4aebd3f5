"""The bench layer: measurements of the engine, and their pictures.

- :mod:`.sweeps`: ``pybmoe sweep``, the cache benchmarked with ``llama-bench`` or ``llama-server``
  requests (cache off interleaved with cache on, repeats, medians, overflow detection);
- :mod:`.devbench`: the analysis of ``tools/device-bench.sh`` (measured points against the
  bandwidth model);
- :mod:`.plot`: the PNGs of replay sweeps (:func:`pybmoe.routing.sim.sweep`) and of benchmarks.

Layer rule (``tests/test_layering.py``): bench may import ``pybmoe.routing`` and ``pybmoe.engine``
(and below), never ``pybmoe.cli``.
"""
