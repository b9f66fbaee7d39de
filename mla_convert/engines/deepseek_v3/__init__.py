"""The DeepSeek-V3 folder format (not an engine): what it accepts of the RoPE, the tensor mapping, the folder writer with its parity, and the serve commands; transformers, vLLM and MLX-LM read it."""
