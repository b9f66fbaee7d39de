"""MLX-LM: its probe and check of a DeepSeek-V3 export (it reads any export target)."""
