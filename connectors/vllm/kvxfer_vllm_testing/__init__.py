"""What kvxfer's tests and ``kvxfer bench vllm`` run around the connector: real P/D deployments
(``harness``), the bench (``bench``), a random-weight model made offline (``tiny_model``) and a
throwaway CA (``pki``). Not part of the shipped ``kvxfer_vllm`` package (the wheel holds only the
connector and the router's client): importable from a checkout with ``connectors/vllm`` on the path.
"""
