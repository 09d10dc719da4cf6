"""The agent: prompts, the ReAct response format and the models it runs on."""
