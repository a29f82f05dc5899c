"""The OpenAI-compatible endpoint a generating rank serves to agents inside the job
(docs/pages/how-to/your-own-agent.md): per-episode keys (keys.py), the recorded token-level
conversation of each episode (conversation.py), the OpenAI request and response bodies
(openai_api.py), and the HTTP server (server.py). Nothing here knows Ray, Slurm or the trainer."""
