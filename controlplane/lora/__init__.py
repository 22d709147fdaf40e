"""Multi-LoRA serving, the controlplane's half: which adapters exist, which
the workers hold, and what a request names (docs/lora.md)."""
