"""Helpers shared by the two daemons and the `kvloom` CLI (kvloom_cli, which
starts them): logging set-up, the /metrics endpoint, ports, CPU core plans,
TLS and secret files, process helpers, option-driven config parsing, the
default-model converter. The client library (kvloom.client, kvloom.api)
never imports them; some need the `kvloom[server]` or
`kvloom[default-model]` extras (gguf for the converter, cryptography for
certificates)."""
