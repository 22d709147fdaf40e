"""Model implementations keyed by Hugging Face architecture name."""
