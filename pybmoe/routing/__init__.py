"""The routing layer: which experts the router picks, and what a cache of them would hit.

- :mod:`.trace`: the trace formats (engine CSV, Parquet, granite JSON, JSONL) and their statistics;
- :mod:`.synth`: long synthetic traces that keep a short real trace's reuse;
- :mod:`.sim`: replay of cache policies over a trace (``layer-lru`` is the engine's policy,
  exactly), in its compiled core ``_simcore.c`` (``_simcore.so`` next to :mod:`.sim`, loaded
  with ctypes; the only implementation of the replay);
- :mod:`.sizing`: the slots-per-layer recommendation (the rules the engine's ``auto`` follows);
- :mod:`.granite`: the bundled granite trace and its form for ``--moe-route-replay``.

Layer rule (``tests/test_layering.py``): routing imports only ``pybmoe.models`` below it (the
GGUF reader, the models of a trace's shape), never ``pybmoe.engine`` (its sibling: nothing here
runs a binary) nor anything above.
"""
