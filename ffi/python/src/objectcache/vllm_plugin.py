"""vLLM plugin entry point (``vllm.general_plugins``): registers ``ObjectCacheConnector`` by
name in vLLM's connector registry, in every vLLM process (API server, engine, workers).

vLLM looks connectors up by name where no module path is at hand, e.g. its MultiConnector when
it rebuilds a sub-connector's statistics in the API server process; and with the name
registered, ``"kv_connector": "ObjectCacheConnector"`` works without
``kv_connector_module_path``. Importing this module imports nothing heavy; vLLM calls
:func:`register` once per process, maybe more (it is idempotent).
"""

#: The connector's name in vLLM's registry.
NAME = "ObjectCacheConnector"


def register():
    """Registers the connector with vLLM's ``KVConnectorFactory`` unless it already is."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(NAME, "objectcache.vllm", NAME)
