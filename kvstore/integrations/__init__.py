"""Engine integrations. Each submodule needs its engine's package (an optional dependency):

* :mod:`kvstore.integrations.hf` — HF transformers (``pip install 'kvstore[hf]'``).

Nothing here is imported by the rest of kvstore; import the submodule you need directly.
"""
