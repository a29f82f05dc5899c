"""PPO and GRPO: the training settings (config.py), the driver loop (loop.py) and what a driver works
with (context.py), prompts (data.py), the built-in task (tasks/), and the role workers (roles/)."""
