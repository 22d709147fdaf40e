"""kvloom: the generated protobuf API (`kvloom.v1`), the client library and the `kvloom` CLI."""

__version__ = "0.1.0"
