"""pybmoe.bench.disk.probe: O_DIRECT reads of the model's own expert projections, into reused or fresh pages."""
from __future__ import annotations

import pytest

from pybmoe.bench import disk


@pytest.mark.parametrize("fresh", [False, True])
def test_the_probe_reads_distinct_expert_windows_of_the_file(model_q8, fresh):
    windows, size = disk.expert_windows(model_q8)
    p = disk.probe(model_q8, lanes=2, total_mib=4.0, fresh=fresh)
    assert p.fresh is fresh and p.lanes == 2 and p.read_bytes == size
    assert p.reads == min(len(windows), max(2, int(4.0 * disk.MIB / size)))
    assert p.mib_s > 0 and p.seconds > 0
    assert all(off % disk.ALIGN == 0 and length % disk.ALIGN == 0 for off, length in windows)


@pytest.mark.parametrize("kw", [dict(lanes=0), dict(lanes=65), dict(total_mib=0.0)])
def test_bad_arguments_are_refused(model_q8, kw):
    with pytest.raises(ValueError, match="accepted"):
        disk.probe(model_q8, **kw)
