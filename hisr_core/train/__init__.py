"""The training engine (engine: torch or DeepSpeed), the shared fit loop (fit), behaviour cloning (sft) and token scoring (scoring)."""
