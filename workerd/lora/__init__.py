"""Multi-LoRA serving on a worker (issue 46): PEFT adapters read from disk
(peft_checkpoint), attached to the tensor-parallel linear layers (layers)
and managed per rank (manager). ../shared/design/lora.md has the design."""
