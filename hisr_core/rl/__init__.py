"""Reinforcement learning: PPO/GRPO math (ppo) and the multi-turn training loop (loop)."""
