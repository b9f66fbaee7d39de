"""The engines a conversion runs in, one folder each (what it accepts, its export, its probe and check), and the
DeepSeek-V3 folder format three of them read; :mod:`mla_convert.engines.registry` is the table of them."""
