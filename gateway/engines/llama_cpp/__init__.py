"""The llama.cpp engine: a built-in GGUF model on the CPU through llama-cpp-python."""
