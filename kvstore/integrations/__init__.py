"""Engine integrations. Each submodule needs its engine's package (an optional dependency):

* :mod:`kvstore.integrations.hf` — HF transformers (``pip install 'kvstore[hf]'``).
* :mod:`kvstore.integrations.sglang` — SGLang HiCache storage backend (sglang needed only when
  the class is built; loaded through SGLang's "dynamic" storage backend).

Nothing here is imported by the rest of kvstore; import the submodule you need directly.
"""
