"""The rollout engine (engine), its generation backends (hf, openai_backend) and the filters applied to collected episodes."""
