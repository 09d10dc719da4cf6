"""Segmentation of trajectories into sub-goal segments: rule, entropy, turn (segmenter) and LLM (llm)."""
