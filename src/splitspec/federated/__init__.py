"""Federated speculative inference (SpecFed): top-K compression, workers, the coordinator.

See :mod:`splitspec.federated.topk` for the compression, reconstruction and error accounting,
:mod:`splitspec.federated.worker` and :mod:`splitspec.federated.coordinator` for the roles and
:mod:`splitspec.protocol.fed` for their wire messages.
"""
