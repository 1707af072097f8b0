"""kvxfer's vLLM V1 KV connector.

vLLM loads ``kvxfer_vllm.connector.KvxferConnector`` (the thin adapter, the one
module that imports vLLM); everything else here is plain Python that the tests
drive without vLLM. Reading order: README.md, then ``connector.py``,
``scheduler.py`` and ``worker.py`` (one per role), ``link.py`` (the engine link),
``layout.py`` (vLLM's KV tensors as a kvxfer layout), ``shm.py`` (the KV cache in
shared-memory files), ``params.py`` (``kv_transfer_params``).
"""

__version__ = "0.1.0"
