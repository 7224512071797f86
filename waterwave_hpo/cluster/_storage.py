"""Serving the driver's study storage to host actors with Optuna's gRPC storage proxy.

Host actors run trials on other processes and other nodes, so they cannot share the driver's
``optuna.Study`` object. The driver serves the study's own storage (in-memory, RDB or journal,
whatever the user passed) with Optuna's gRPC storage proxy (``optuna.storages.GrpcStorageProxy``,
Optuna >= 4.2), and every host actor opens the study through it. One server is the only process
that touches the storage, which is what Optuna recommends for many workers on one RDB, and it
makes an in-memory study on the driver work on a cluster.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
import contextlib
from dataclasses import dataclass
from typing import Any

import optuna

from waterwave_hpo.cluster._imports import import_grpc


@dataclass(frozen=True)
class StorageAddress:
    """Where host actors reach the study's storage: a gRPC storage proxy server.

    Attributes:
        host: The driver's address as the cluster's nodes see it (an IP).
        port: The TCP port the proxy listens on.
    """

    host: str
    port: int

    def connect(self, timeout_s: float = 30.0) -> optuna.storages.BaseStorage:
        """Open a ``GrpcStorageProxy`` to this address and wait until the server answers.

        Raises:
            ConnectionError: If the server does not answer within ``timeout_s`` seconds.
        """
        import_grpc()
        from optuna.storages import GrpcStorageProxy

        proxy = GrpcStorageProxy(host=self.host, port=self.port)
        proxy.wait_server_ready(timeout=timeout_s)
        return proxy


class StorageProxyServer:
    """A gRPC server, in the driver's process, that proxies one Optuna storage.

    Args:
        storage: The storage to serve (``study._storage``).
        host: The address to listen on; the driver's node IP on a cluster.
        max_workers: Server threads (concurrent storage calls).

    Raises:
        ImportError: If grpcio is not installed.
    """

    def __init__(self, storage: optuna.storages.BaseStorage, host: str, max_workers: int = 16):
        grpc = import_grpc()
        # Optuna's public run_grpc_proxy_server() blocks forever and cannot pick a free port;
        # this is its make_server() with the port the OS chose (optuna/storages/_grpc/server.py).
        from optuna.storages._grpc import servicer
        from optuna.storages._grpc.auto_generated import api_pb2_grpc

        self._server: Any = grpc.server(ThreadPoolExecutor(max_workers=max_workers))
        api_pb2_grpc.add_StorageServiceServicer_to_server(  # type: ignore[no-untyped-call]
            servicer.OptunaStorageProxyService(storage), self._server
        )
        port = int(self._server.add_insecure_port(f"{host}:0"))
        if port == 0:
            raise OSError(f"The gRPC storage proxy could not listen on {host}.")
        self.address = StorageAddress(host, port)
        self._server.start()

    def stop(self, grace_s: float = 1.0) -> None:
        """Stop serving; calls in flight get ``grace_s`` seconds to finish. Idempotent."""
        with contextlib.suppress(Exception):
            self._server.stop(grace_s).wait(grace_s + 1.0)

    def __enter__(self) -> StorageProxyServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
