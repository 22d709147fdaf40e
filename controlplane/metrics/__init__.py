"""Prometheus metrics of the controlplane: the exporter, the gRPC call
interceptor and the engine-side step records they are fed from."""
