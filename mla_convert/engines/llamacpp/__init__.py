"""llama.cpp: its cache blocks, the conversion shaped for its row, the GGUF export and vocabulary, its venv, quantizer, probe and check."""
