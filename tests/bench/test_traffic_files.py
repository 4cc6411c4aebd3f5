"""Mangled traffic files of ``pybmoe sweep --runner server`` (issue 16): each example failed before its
fix (another exception, or a request silently misread); tests/routing/test_fuzz_parsers.py fuzzes
load_traffic."""
from __future__ import annotations

import pytest

from pybmoe.bench import sweeps


@pytest.mark.parametrize("data, message", [
    (b'{"requests": [{"prompt": "\xff"}]}', r"t.json:1: byte 0xff is not UTF-8 text"),        # UnicodeDecodeError
    (b"[" * 100000, r"nested too deeply"),                                                     # RecursionError
    (b'{"requests": [{"prompt": "x", "n_predcit": 5}]}', r"request 0 has the key\(s\) \['n_predcit'\]"),  # ignored
    (b'{"requests": [{"prompt": "x", "name": [1]}]}', r"request 0 has the name \[1\]"),       # a list as a name
    (b'{"requests": [{"prompt": "x", "n_predict": 100000000000000000000}]}', r"n_predict\" 1 .. 2147483647"),
    (b'{"requests": [3]}', r"request 0 is int 3"),
    (b'{"requests": [{"prompt": "x"}]', r"t.json:1: not JSON"),
])
def test_a_mangled_traffic_file_is_refused(tmp_path, data, message):
    path = tmp_path / "t.json"
    path.write_bytes(data)
    with pytest.raises(sweeps.TrafficFormatError, match=message) as e:
        sweeps.load_traffic(path)
    assert str(path) in str(e.value)


def test_a_byte_order_mark_is_skipped(tmp_path):
    path = tmp_path / "t.json"
    path.write_bytes(b'\xef\xbb\xbf{"requests": [{"prompt": "x", "n_predict": 3}]}')
    assert sweeps.load_traffic(path) == [{"name": "request-0", "prompt": "x", "n_predict": 3}]
