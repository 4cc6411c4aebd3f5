"""The bundled granite-3.0-1b-a400m routing trace (:data:`GRANITE_TRACE`, MIT notice beside it) and
its form for the engine's ``--moe-route-replay`` (:func:`granite_replay`)."""
from __future__ import annotations

from pathlib import Path

from .. import models
from . import trace

#: The bundled trace: 24 MoE layers, 32 experts, top-8 (granite JSON, read by :func:`trace.read_trace`, which
#: also takes its short name, ``granite``: :data:`trace.PACKAGED_TRACES`).
GRANITE_TRACE = trace.PACKAGED_TRACES["granite"]


def granite_replay_csv(workload: str = "english_prose") -> tuple[Path, int]:
    """The bundled granite routing trace as an engine replay file (``--moe-route-replay``), for a
    model of its shape (24 layers, 32 experts, top-8): ``(trace_csv, prompt_tokens)``, as
    :func:`granite_replay` (which also gives the model). The file is cached in
    :func:`models.cache_dir`. Raises ValueError for an unknown workload."""
    import pandas as pd

    tr = trace.read_granite_json(GRANITE_TRACE)
    names = list(dict.fromkeys(tr.frame.workload.astype(str)))  # file order
    if workload not in names:
        raise ValueError(f"workload {workload!r} is not in the granite trace; accepted: {', '.join(names)}")
    f = tr.frame
    order = [workload] + [n for n in names if n != workload]
    frame = pd.concat([f[f.workload == n] for n in order], ignore_index=True)
    csv = models.cache_dir() / f"granite-routing-{workload}.csv"
    if not csv.is_file():
        trace.write_trace(trace.from_frame(frame, tr.meta), csv)
    n_prompt = int(f[(f.workload == workload) & (f.phase == "prefill")].token.nunique())
    return csv, n_prompt


def granite_replay(workload: str = "english_prose") -> tuple[Path, Path, int]:
    """The bundled granite routing trace as an engine replay file, and a model of its shape.

    Returns ``(model, trace_csv, prompt_tokens)``: the granite-shaped tiny model
    (:data:`models.GRANITE_TRACE_SPEC`: 24 layers, 32 experts, top-8), the trace with
    ``workload`` first (its prefill, then its 64 decode tokens; the other prompts follow), and
    the number of prefill tokens of ``workload`` (a prompt of that many tokens lines the engine's
    decode steps up with the trace's decode tokens). Both files are cached in
    :func:`models.cache_dir`. Raises ValueError for an unknown workload.
    """
    csv, n_prompt = granite_replay_csv(workload)
    return models.cached_model_path(models.GRANITE_TRACE_SPEC), csv, n_prompt
