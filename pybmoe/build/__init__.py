"""The build layer: the pinned upstream llama.cpp and the patch series over it.

- :mod:`.vendor`: fetch, verify, unpack and patch the pinned sdist into ``vendor/src/``; find the
  checkout (:func:`~.vendor.project_root`: the working directory first, then ``$PYBMOE_ROOT``,
  then the folder the package sits in);
- :mod:`.patches`: list, check, export and rebase ``patches/series``;
- :mod:`.trees`: the llama.cpp tree a rebase goes onto (a directory, a tarball, a git ref, a
  version), found at any depth, and its digest;
- :mod:`.abi`: ctypes declarations (the ``llama_cpp`` bindings, pybmoe's own) against a C header,
  signatures and struct layouts, with the C++ compiler as the judge.

Bottom layer: imports nothing of pybmoe outside this package (``tests/test_layering.py``).
"""
