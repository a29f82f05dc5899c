"""PPO and GRPO: the training settings (config.py), the driver loop (driver.py), prompts (data.py),
the built-in task (tasks/), and the role workers (roles/)."""
