"""Reward models and modulation: the segment/turn SPRM (sprm), the hindsight model (hindsight, gated_attention) and the hindsight-modulated segment rewards (modulation)."""
