"""vLLM: its served row and head widths, the conversion shaped for it, its probe and check, and the plugin that serves our MLA folders with no export."""
