"""The transformers + peft engine (CPU or one GPU)."""
