"""What --kv-transfer-config adds to a controlplane, built in one place
(server.py calls it): the layout's fixed part every start-up completes, the
engine's lease and release hooks, the producer's service and the consumer's
client of its producers."""

from __future__ import annotations

from controlplane.api.kv_transfer.producers import RemoteProducers
from controlplane.config import ControlPlaneConfig
from controlplane.core.kv_leases import ProducerIdentity
from controlplane.engine.kv_transfer import EngineKVTransfer
from controlplane.model_info import ModelInfo
from kvloom.common.ports import connect_host
from kvloom.kvtransfer.v1 import kv_transfer_pb2 as pb


class KVTransferWiring:
    def __init__(self, config: ControlPlaneConfig, info: ModelInfo) -> None:
        transfer = config.kv_transfer
        assert transfer is not None
        self.config = transfer
        par = config.parallel
        self.layout_base = pb.KVEngineLayout(
            engine_id=transfer.engine_id, model_architecture=info.architecture,
            num_layers=info.num_hidden_layers, total_num_kv_heads=info.num_key_value_heads,
            head_dim=info.head_dim,
            block_size=config.cache.block_size, tensor_parallel_size=par.tensor_parallel_size,
            pipeline_parallel_size=par.pipeline_parallel_size, lease_s=transfer.lease_s)
        self._server_host = config.server.host
        self.producers: RemoteProducers | None = None
        if transfer.consumes:
            self.producers = RemoteProducers(transfer, self.own_layout)
        self.engine = EngineKVTransfer(
            None, transfer.lease_s,
            self.producers.release_threadsafe if self.producers is not None else None)
        self._model_dtype = lambda: ""

    def own_layout(self) -> pb.KVEngineLayout:
        """This cluster's compatibility facts (a consumer checks producers)."""
        layout = pb.KVEngineLayout()
        layout.CopyFrom(self.layout_base)
        layout.kv_cache_dtype = self._model_dtype()
        return layout

    def bound(self, api_port: int, model_dtype) -> None:
        """The API port is bound: a producer's parameters name it."""
        self._model_dtype = model_dtype
        if self.config.produces:
            # Consumers dial side_channel_host, else the address the API is
            # served on (only loopback behind a wildcard bind).
            host = self.config.side_channel_host or connect_host(self._server_host)
            self.engine.producer = ProducerIdentity(
                self.config.engine_id, host, api_port, self.layout_base.tensor_parallel_size)
